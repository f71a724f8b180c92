"""The engine's events as values: a request lifecycle event, and one StepEvent per step, for the inspector and
other listeners (LLMEngine builds them only while someone listens)."""
from __future__ import annotations

import time

from engine.events import RequestEvent, ScheduledRequest, StepEvent
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence


def request_event(kind: str, seq: Sequence, step: int, finish_reason: str | None = None,
                  message: str | None = None, engine_index: int = 0) -> RequestEvent:
    return RequestEvent(
        kind=kind, request_id=seq.request_id, time=time.perf_counter(), step=step, engine_index=engine_index,
        prompt_len=seq.num_prompt_tokens, output_len=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens, finish_reason=finish_reason,
        block_table=list(seq.block_table) if kind in ("scheduled", "preempted", "swapped_in") else None,
        priority=seq.params.priority,
        message=message, arrival_time=seq.metrics.arrival_time if kind == "arrived" else None,
        structured=seq.params.structured_outputs.kind if kind == "arrived" and seq.params.structured_outputs
        else None)


def phase_of(seq: Sequence, n: int, start: int, enable_kv_cache: bool) -> str:
    """"prefill" or "decode" for n tokens of seq computed from position start."""
    if seq.num_output_tokens == 0:
        return "prefill"
    if n == 1 and start == seq.num_tokens - 1:
        return "decode"
    # the no-cache baseline recomputes a decoding request's whole prefix every step
    return "decode" if not enable_kv_cache and start == 0 and n == seq.num_tokens else "prefill"


def step_event(sched: SchedulerOutput, step: int, t0: float, t1: float, finished: list[str], **fields) -> StepEvent:
    """fields: StepEvent's counters and measurements (num_running, kv_usage, timings, memory, spec, ...)."""
    scheduled = []
    n_pre = n_dec = 0
    for seq, n, start, k, phase, total in zip(sched.seqs, sched.num_new_tokens, sched.computed_before,
                                              sched.num_spec_tokens, sched.phases, sched.total_lens):
        if phase == "prefill":
            n_pre += n
        else:
            n_dec += n
        scheduled.append(ScheduledRequest(seq.request_id, n, phase, start, total, k))
    return StepEvent(step=step, start=t0, end=t1, scheduled=scheduled, num_prefill_tokens=n_pre,
                     num_decode_tokens=n_dec, preempted=[s.request_id for s in sched.preempted], finished=finished,
                     swapped_out=[s.request_id for s in sched.swapped_out],
                     swapped_in=[s.request_id for s in sched.swapped_in], **fields)
