"""Event emission of LLMEngine: request lifecycle events and one StepEvent per step, for the inspector and
other listeners (nothing is built while no one listens)."""
from __future__ import annotations

import time

from engine.events import RequestEvent, ScheduledRequest, StepEvent
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence


class StepEvents:
    """Mixed into LLMEngine; uses its event bus, scheduler, block manager, runner and drafter."""

    def _emit_req(self, kind: str, seq: Sequence, finish_reason: str | None = None, message: str | None = None):
        if not self.events.active:
            return
        self.events.emit(RequestEvent(
            kind=kind, request_id=seq.request_id, time=time.perf_counter(), step=self.step_index,
            prompt_len=seq.num_prompt_tokens, output_len=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, finish_reason=finish_reason,
            block_table=list(seq.block_table) if kind in ("scheduled", "preempted") else None,
            priority=seq.params.priority,
            message=message, arrival_time=seq.metrics.arrival_time if kind == "arrived" else None,
            structured=seq.params.structured_outputs.kind if kind == "arrived" and seq.params.structured_outputs
            else None))

    def _phase(self, seq: Sequence, n: int, start: int) -> str:
        if seq.num_output_tokens == 0:
            return "prefill"
        if n == 1 and start == seq.num_tokens - 1:
            return "decode"
        # the no-cache baseline recomputes a decoding request's whole prefix every step
        return "decode" if not self.config.cache_config.enable_kv_cache and start == 0 and n == seq.num_tokens \
            else "prefill"

    def _emit_step(self, sched: SchedulerOutput, t0: float, t1: float, finished: list[str],
                   timings: dict, cuda_graph: bool = False, num_decode_steps: int = 1,
                   rank_timings: dict | None = None):
        scheduled = []
        n_pre = n_dec = 0
        for seq, n, start, k, phase, total in zip(sched.seqs, sched.num_new_tokens, sched.computed_before,
                                                  sched.num_spec_tokens, sched.phases, sched.total_lens):
            if phase == "prefill":
                n_pre += n
            else:
                n_dec += n
            scheduled.append(ScheduledRequest(seq.request_id, n, phase, start, total, k))
        spec = self.drafter.pop_step_stats() if self.drafter is not None else None
        self.events.emit(StepEvent(
            step=self.step_index, start=t0, end=t1, scheduled=scheduled,
            num_prefill_tokens=n_pre, num_decode_tokens=n_dec,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            preempted=[s.request_id for s in sched.preempted], finished=finished,
            kv_usage=self.block_manager.usage, num_blocks=self.num_blocks,
            timings=timings, cuda_graph=cuda_graph, num_decode_steps=num_decode_steps, spec=spec,
            memory=self.memory_stats(), timings_sampled=self.runner.pop_timing_sampled(),
            rank_timings=rank_timings,
            **self.block_manager.pop_step_stats()))
