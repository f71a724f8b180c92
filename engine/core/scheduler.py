"""Token-budget scheduler in the style of vLLM V1.

Each step every scheduled request's `num_computed_tokens` moves toward its `num_tokens` (+ draft tokens),
within `max_num_batched_tokens` and `max_num_seqs`: running requests first (decodes and unfinished
prefill chunks), then waiting ones FCFS. Prefill chunks and decodes share one forward pass. When blocks
run out the most recently admitted running request is preempted (recompute) and rejoins the front of
the waiting queue.

With a host tier (kv_offload_gib > 0) a preempted request may instead be swapped: its blocks are copied to
host memory and back when it is readmitted, keeping its computed tokens. `preemption_mode` picks swap or
recompute, or "auto" per request by SwapCostModel: copying its blocks out and back against prefilling its
tokens again.

`scheduling_policy="priority"` (vLLM's): the waiting queue is a heap on (SamplingParams.priority,
arrival time, insertion count), lower first, and preempted requests rejoin it by the same key. When
running requests need blocks the victim is the worst running request (largest priority, then latest
arrival). When the best waiting request cannot get blocks, or the batch is at `max_num_seqs`, and a
running request has a strictly larger priority value, the worst running one is preempted to make room.
The step's token budget goes out best first too: running requests in (priority, arrival) order, and a
waiting request with a strictly smaller priority value than a running one is admitted before it (so a
high-priority prompt is not left without budget behind low-priority prefill chunks). With equal
priorities the step is the FCFS one.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import BlockManager
from engine.config import EngineConfig
from engine.core.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)    # per seq, tokens computed this step
    num_spec_tokens: list[int] = field(default_factory=list)   # per seq, draft tokens among them
    computed_before: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)  # the preempted ones whose blocks went to the host
    swapped_in: list[Sequence] = field(default_factory=list)   # admitted ones whose blocks come back from it
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) copies, run first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device) copies
    phases: list[str] = field(default_factory=list)            # filled by the engine when observed
    total_lens: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def subset(self, idx: list[int]) -> "SchedulerOutput":
        """The step of seqs[i] for i in idx alone (a failed step re-run in parts); the others keep their blocks
        and are scheduled again next step. Preemptions, admissions and the swap copies (already run) stay with the
        original step."""
        pick = lambda xs: [xs[i] for i in idx] if xs else []
        admitted = {id(s) for s in self.admitted}
        return SchedulerOutput(seqs=pick(self.seqs), num_new_tokens=pick(self.num_new_tokens),
                               num_spec_tokens=pick(self.num_spec_tokens), computed_before=pick(self.computed_before),
                               admitted=[s for s in pick(self.seqs) if id(s) in admitted],
                               phases=pick(self.phases), total_lens=pick(self.total_lens))


@dataclass
class SwapCostModel:
    """Swap or recompute a preempted request: the time to copy its blocks out and back (block_bytes at
    copy_bytes_per_s each way) against the time to prefill its computed tokens again (prefill_tokens_per_s,
    updated by observe() from the engine's prefill steps)."""
    block_bytes: int
    copy_bytes_per_s: float
    prefill_tokens_per_s: float

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefer_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step that computed num_tokens tokens took seconds (moving average)."""
        if num_tokens >= 64 and seconds > 0:
            self.prefill_tokens_per_s = 0.8 * self.prefill_tokens_per_s + 0.2 * num_tokens / seconds


class PriorityWaitingQueue:
    """The waiting queue under `scheduling_policy="priority"`: a heap on (priority, arrival time, insertion
    count). Reads like the FCFS deque where other code reads it: len(), truthiness, iteration (best first),
    remove()."""

    def __init__(self):
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._count = itertools.count()

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.params.priority, seq.metrics.arrival_time, next(self._count), seq))

    def peek(self) -> Sequence:
        return self._heap[0][3]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[3]

    def remove(self, seq: Sequence) -> None:
        for j, e in enumerate(self._heap):
            if e[3] is seq:
                last = self._heap.pop()
                if j < len(self._heap):
                    self._heap[j] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError("not in the waiting queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return iter([e[3] for e in sorted(self._heap)])   # keys are unique: never compares sequences

    def __contains__(self, seq) -> bool:
        return any(e[3] is seq for e in self._heap)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.priority = config.scheduler_config.scheduling_policy == "priority"
        self.waiting: deque[Sequence] | PriorityWaitingQueue = PriorityWaitingQueue() if self.priority else deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swaps = 0
        self.preemption_mode = config.cache_config.preemption_mode
        self.cost_model: SwapCostModel | None = None    # set by the engine with a host tier

    def add(self, seq: Sequence) -> None:
        if self.priority:
            self.waiting.push(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _should_swap(self, seq: Sequence) -> bool:
        if self.preemption_mode == "recompute" or not self.bm.can_swap_out(seq):
            return False
        if self.preemption_mode == "swap" or self.cost_model is None:
            return True
        return self.cost_model.prefer_swap(seq.num_computed_tokens, len(seq.block_table))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.spec_token_ids = []
        if self._should_swap(seq):
            self.bm.swap_out(seq)                 # keeps its computed tokens, its blocks in the host tier
            self.num_swaps += 1
            out.swapped_out.append(seq)
        else:
            self.bm.free(seq)
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if self.priority:
            self.waiting.push(seq)
        else:
            self.waiting.appendleft(seq)
        out.preempted.append(seq)

    @staticmethod
    def _key(seq: Sequence) -> tuple[int, float]:
        return seq.params.priority, seq.metrics.arrival_time

    @staticmethod
    def _unschedule(out: SchedulerOutput, seq: Sequence) -> int:
        """Take back `seq`'s place in this step (it is about to be preempted); returns the tokens it had."""
        for j, s in enumerate(out.seqs):
            if s is seq:
                del out.seqs[j], out.num_spec_tokens[j], out.computed_before[j]
                return out.num_new_tokens.pop(j)
        return 0

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_priority() if self.priority else self._schedule_fcfs()
        out.blocks_to_swap_out, out.blocks_to_swap_in = self.bm.pop_copies()
        return out

    def _schedule_fcfs(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.scheduler_config.max_num_batched_tokens
        chunked = cfg.scheduler_config.enable_chunked_prefill

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
        admit = not out.preempted and (cfg.scheduler_config.scheduling == "continuous" or not self.running)
        while admit and self.waiting and budget > 0 and len(self.running) < cfg.scheduler_config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._fit_waiting(seq, budget)
            if not num_new:
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._admit(out, seq, num_new)
            budget -= num_new
        return out

    def _fit_waiting(self, seq: Sequence, budget: int) -> int | None:
        """Match a waiting request's cached prefix and size its first chunk: the tokens it computes now, 0
        when the free blocks are too few, None when it does not fit the budget (chunked prefill off); the
        prefix match is undone unless it fits."""
        self.bm.match_prefix(seq)
        want = seq.num_tokens - seq.num_computed_tokens
        if not self.config.scheduler_config.enable_chunked_prefill and want > budget:
            self._undo_match(seq)
            return None
        num_new = min(want, budget)
        if not self.bm.can_allocate(seq, num_new):
            self._undo_match(seq)
            return 0
        return num_new

    def _admit(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        """A request leaving the waiting queue (the caller placed it in `running`) computes its first chunk."""
        self.bm.record_admission(seq)
        if seq.host_block_table:
            self.bm.swap_in(seq)
            out.swapped_in.append(seq)
        self.bm.allocate(seq, num_new)
        seq.status = SequenceStatus.RUNNING
        out.admitted.append(seq)
        seq.admitted = True
        self._emit(out, seq, num_new, 0)

    # ---- scheduling_policy="priority" ------------------------------------------------------------
    def _schedule_priority(self) -> SchedulerOutput:
        """The step under the priority policy: the token budget goes out best first. Running requests are kept
        sorted by (priority, arrival) (so the worst is last, the preemption victim), and a waiting request with
        a strictly smaller priority value than a running one is admitted before that one is served. With
        equal priorities this is the FCFS step (running first, then waiting by arrival)."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.scheduler_config.max_num_batched_tokens
        chunked = cfg.scheduler_config.enable_chunked_prefill
        admit = cfg.scheduler_config.scheduling == "continuous" or not self.running   # static: only into an empty batch
        evicted: set[int] = set()          # preempted for a waiting request: not readmitted in this step
        served: set[int] = set()
        self.running.sort(key=self._key)   # stable: admissions are inserted in order below
        for seq in list(self.running):
            if budget <= 0:
                break
            if admit and self.waiting and self.waiting.peek().params.priority < seq.params.priority:
                budget = self._admit_priority(out, budget, evicted, served, below=seq.params.priority)
                if budget <= 0:
                    break
            if seq.status is not SequenceStatus.RUNNING:    # preempted in this step as someone's victim
                continue
            num_spec = len(seq.spec_token_ids)
            want = seq.num_tokens + num_spec - seq.num_computed_tokens
            if not chunked and want - num_spec > budget:
                continue
            if want - num_spec > 1 and self._outranked_prefill(out, seq):
                continue
            num_new = min(want, budget)
            if num_new < want:
                num_spec = max(0, num_spec - (want - num_new))
                seq.spec_token_ids = seq.spec_token_ids[:num_spec]
            scheduled = True
            while not self.bm.can_allocate(seq, num_new):
                if num_spec:
                    num_new, num_spec, seq.spec_token_ids = num_new - num_spec, 0, []
                    continue
                victim = self.running.pop()                 # the worst running request
                if id(victim) in served:
                    served.discard(id(victim))
                    budget += self._unschedule(out, victim)
                self._preempt(victim, out)
                admit = False                               # as FCFS: no admissions after a preemption
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                continue
            self.bm.allocate(seq, num_new)
            self._emit(out, seq, num_new, num_spec)
            served.add(id(seq))
            budget -= num_new
        if admit and budget > 0:
            self._admit_priority(out, budget, evicted, served)
        return out

    def _admit_priority(self, out: SchedulerOutput, budget: int, evicted: set[int], served: set[int],
                        below: int | None = None) -> int:
        """Admit waiting requests best first (only those with priority < `below` when given); one that finds no
        room (blocks or a batch slot) preempts the worst running request if that one's priority value is
        strictly larger. Returns the budget left."""
        cfg = self.config
        while self.waiting and budget > 0:
            seq = self.waiting.peek()
            if id(seq) in evicted or (below is not None and seq.params.priority >= below):
                break
            if len(self.running) >= cfg.scheduler_config.max_num_seqs:
                if self._preempt_for(seq, out, evicted):
                    budget += self._take_back(out, served)
                    continue
                break
            if self._outranked_prefill(out, seq):
                break
            num_new = self._fit_waiting(seq, budget)
            if num_new is None:
                break
            if num_new == 0:                               # too few free blocks
                if self._preempt_for(seq, out, evicted):
                    budget += self._take_back(out, served)
                    continue
                break
            self.waiting.pop()
            bisect.insort(self.running, seq, key=self._key)
            self._admit(out, seq, num_new)
            served.add(id(seq))
            budget -= num_new
        return budget

    @staticmethod
    def _outranked_prefill(out: SchedulerOutput, seq: Sequence) -> bool:
        """A step that prefills for a better request carries no prompt chunks of worse ones (their decodes
        still run): the better request's first token then waits for its own prompt only, which on a slow
        device is the difference between a fraction of a second and several."""
        p = seq.params.priority
        return any(n > 1 and s.params.priority < p for s, n in zip(out.seqs, out.num_new_tokens))

    def _preempt_for(self, seq: Sequence, out: SchedulerOutput, evicted: set[int]) -> bool:
        """Preempt the worst running request for waiting `seq` if its priority value is strictly larger."""
        if not self.running or self.running[-1].params.priority <= seq.params.priority:
            return False
        victim = self.running.pop()
        evicted.add(id(victim))
        self._preempt(victim, out)
        return True

    def _take_back(self, out: SchedulerOutput, served: set[int]) -> int:
        """The tokens the request just preempted had in this step (0 if it was not served yet)."""
        victim = out.preempted[-1]
        if id(victim) in served:
            served.discard(id(victim))
            return self._unschedule(out, victim)
        return 0

    def _undo_match(self, seq: Sequence) -> None:
        if seq.host_block_table:                  # swapped out: nothing was matched, its tokens stay computed
            return
        if seq.block_table:
            self.bm.free(seq)
        seq.num_computed_tokens = 0

    def can_schedule_block(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """Whether the pool holds the blocks for num_tokens[i] more tokens of each seqs[i] (a multi-step block)."""
        need = sum(self.bm.blocks_needed(s, s.num_computed_tokens + n) for s, n in zip(seqs, num_tokens))
        return need <= self.bm.pool.num_free

    def schedule_block(self, seqs: list[Sequence], K: int, extra: list[int]) -> SchedulerOutput:
        """A multi-step decode block: every seqs[i] computes K tokens (1 known + K - 1 sampled on the way)
        after the extra[i] positions still in flight; the blocks for all of them are allocated now (check first
        with can_schedule_block)."""
        out = SchedulerOutput()
        self._schedule_after(out, seqs, [K] * len(seqs), extra)
        out.blocks_to_swap_out, out.blocks_to_swap_in = self.bm.pop_copies()
        return out

    def schedule_mixed(self, seqs: list[Sequence], extra: list[int], admissible,
                       num_new: list[int]) -> SchedulerOutput:
        """A step launched without a host sync: each seqs[i] computes num_new[i] tokens (one for a decode) after
        its extra[i] positions in flight (the caller checked the blocks), then waiting requests are admitted
        first come first served, whole prompts only, while `admissible(seq)`, the budget, the batch and the free
        blocks allow. Nobody is preempted: tokens in flight are not on the host yet."""
        cfg = self.config.scheduler_config
        out = SchedulerOutput()
        self._schedule_after(out, seqs, num_new, extra)
        budget = cfg.max_num_batched_tokens - sum(num_new)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not admissible(seq) or seq.host_block_table:
                break
            n = self._fit_waiting(seq, budget)
            if not n:
                break
            if n < seq.num_tokens - seq.num_computed_tokens:           # a first chunk samples nothing
                self._undo_match(seq)
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._admit(out, seq, n)
            budget -= n
        out.blocks_to_swap_out, out.blocks_to_swap_in = self.bm.pop_copies()
        return out

    def _schedule_after(self, out: SchedulerOutput, seqs: list[Sequence], num_new: list[int],
                        extra: list[int]) -> None:
        """seqs[i] computes num_new[i] tokens after its extra[i] positions in flight."""
        for seq, k, e in zip(seqs, num_new, extra):
            self.bm.allocate(seq, e + k)
            out.seqs.append(seq)
            out.num_new_tokens.append(k)
            out.num_spec_tokens.append(0)
            out.computed_before.append(seq.num_computed_tokens + e)

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
