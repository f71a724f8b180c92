"""Prefill behind an in-flight decode block (EngineConfig.overlap_prefill).

When requests arrive while multi-step decoding is pipelined, the plain path lets every block already on
the device finish, hands their tokens to the host, and only then runs a mixed prefill + decode step,
launched from the host while the GPU idles. Here the newcomers get a step of their own instead: their
prefill is launched right behind the block in flight (it reads and writes only the newcomers' KV blocks,
so it does not need that block's tokens), the host processes the block's tokens while the GPU runs the
prefill, and then samples the newcomers' first tokens. The running requests skip no work: they simply
are not in this step, and the next block carries everyone.

Applies when the engine would admit newcomers now (`multi_step._admit_now`) and nothing needs the host
between forward and sampling that a step of waiting requests could not give: no drafter, no grammar.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.core.scheduler import SchedulerOutput
from engine.worker.timing import NullTimer


@dataclass
class PendingPrefill:
    sched: SchedulerOutput
    sample_mask: list[bool]
    logits: torch.Tensor
    t_start: float
    t_scheduled: float
    t_launched: float


def launch(engine, admit_now, observe: bool) -> PendingPrefill | None:
    """Schedule the waiting requests that fit (no preemption) and launch their forward; None when it does
    not apply. `admit_now(engine)`: whether the engine would admit newcomers at this point."""
    sch = engine.scheduler
    if not sch.waiting or engine.drafter is not None or engine.num_constrained or not admit_now(engine):
        return None
    t0 = time.perf_counter()
    sched = sch.schedule_waiting()
    if sched.is_empty:
        return None
    t_sched = time.perf_counter()
    engine.step_index += 1              # its events carry its own index: the block ahead of it is one before
    for seq in sched.admitted:
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = t_sched
        engine._emit_req("scheduled", seq)
    engine.step_index -= 1
    if observe:
        sched.phases = [engine._phase(seq, n, start) for seq, n, start in
                        zip(sched.seqs, sched.num_new_tokens, sched.computed_before)]
        sched.total_lens = [seq.num_tokens for seq in sched.seqs]
    sample_mask = [start + n == seq.num_tokens for seq, n, start in
                   zip(sched.seqs, sched.num_new_tokens, sched.computed_before)]
    # untimed: the block this runs behind owns the step's region timer
    engine.runner.set_timer(NullTimer())
    input_ids, md = engine.runner.prepare(sched, sample_mask, None)
    logits = engine.runner.execute(input_ids, md)
    return PendingPrefill(sched, sample_mask, logits, t0, t_sched, time.perf_counter())


def finish(engine, pre: PendingPrefill, observe: bool) -> list:
    """Sample the newcomers' first tokens (waits for the prefill) and process them as one engine step."""
    t_wait = time.perf_counter()
    tokens, lp_rows = engine._sample(pre.sched, pre.sample_mask, pre.logits)
    t_sample = time.perf_counter()
    if engine.executor is not None:
        engine.executor.check()
    outputs, finished = engine._postprocess(pre.sched, pre.sample_mask, tokens, lp_rows)
    t_end = time.perf_counter()
    engine.step_index += 1
    if observe:
        timings = {"schedule": pre.t_scheduled - pre.t_start, "forward": pre.t_launched - pre.t_scheduled,
                   "sampling": t_sample - t_wait, "postprocess": t_end - t_sample}
        engine._emit_step(pre.sched, pre.t_start, t_end, finished, timings,
                          rank_timings=engine.collect_rank_timings())
    else:
        engine.block_manager.pop_step_stats()
    return outputs
