"""Token-budget scheduler in the style of vLLM V1.

Each step every scheduled request's `num_computed_tokens` moves toward its `num_tokens` (+ draft tokens),
within `max_num_batched_tokens` and `max_num_seqs`: running requests first (decodes and unfinished
prefill chunks), then waiting ones FCFS. Prefill chunks and decodes share one forward pass. When blocks
run out the most recently admitted running request is preempted (recompute) and rejoins the front of
the waiting queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)    # per seq, tokens computed this step
    num_spec_tokens: list[int] = field(default_factory=list)   # per seq, draft tokens among them
    computed_before: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)            # filled by the engine when observed
    total_lens: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        chunked = cfg.enable_chunked_prefill

        # 1. running requests, in admission order
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_spec = len(seq.spec_token_ids)
            want = seq.num_tokens + num_spec - seq.num_computed_tokens
            if not chunked and want - num_spec > budget:   # drafts may be cut, the rest may not
                i += 1
                continue
            num_new = min(want, budget)
            if num_new < want:                 # a chunk cut short carries no draft tokens
                num_spec = max(0, num_spec - (want - num_new))
                seq.spec_token_ids = seq.spec_token_ids[:num_spec]  # so the engine samples after the last one
            scheduled = True
            while not self.bm.can_allocate(seq, num_new):
                if num_spec:                   # drop this request's drafts before preempting anyone
                    num_new, num_spec, seq.spec_token_ids = num_new - num_spec, 0, []
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                break
            self.bm.allocate(seq, num_new)
            self._emit(out, seq, num_new, num_spec)
            budget -= num_new
            i += 1

        # 2. waiting requests, FCFS (none if anything was preempted; static: only into an empty batch)
        admit = not out.preempted and (cfg.scheduling == "continuous" or not self.running)
        while admit and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            self.bm.match_prefix(seq)
            want = seq.num_tokens - seq.num_computed_tokens
            if not chunked and want > budget:
                self._undo_match(seq)
                break
            num_new = min(want, budget)
            if not self.bm.can_allocate(seq, num_new):
                self._undo_match(seq)
                break
            self.waiting.popleft()
            self.bm.record_admission(seq)
            self.bm.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            seq.admitted = True
            self._emit(out, seq, num_new, 0)
            budget -= num_new
        return out

    def _undo_match(self, seq: Sequence) -> None:
        if seq.block_table:
            self.bm.free(seq)
        seq.num_computed_tokens = 0

    @staticmethod
    def _emit(out: SchedulerOutput, seq: Sequence, num_new: int, num_spec: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        out.num_spec_tokens.append(num_spec)
        out.computed_before.append(seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
