"""Exports: per-request metrics as CSV (pandas) and the timeline as Chrome-trace JSON (Perfetto,
chrome://tracing).

Trace layout:
  pid 1 "engine"    tid 1: one slice per step, with its measured top-level regions as child slices in
                    execution order (schedule, prepare, forward, sampling, postprocess); tid 2: the forward's
                    sub-regions (attention, mlp, ...) aggregated per step and laid end to end (the engine
                    sums them over layers, so their order inside the forward is not real).
                    Counters: KV usage, batch (running / waiting), tokens per step.
  pid 2 "requests"  one track per request: waiting / prefill / decode / preempted slices.
Data-parallel replicas: replica r's steps on tids 2r + 1 and 2r + 2 of pid 1, its counters named after it.
Times are microseconds since the snapshot's t0.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import pandas as pd

from inspector import metrics as M
from inspector.figures.timings import SUBREGIONS
from inspector.recorder import RequestRecord, Snapshot

_TOP_ORDER = ("schedule", "prepare", "forward", "sampling", "postprocess")


def metrics_frame(records: Iterable[RequestRecord]) -> pd.DataFrame:
    """One row per finished request: stamps (s, perf_counter), token counts, and TTFT/TPOT/E2EL in ms."""
    records = list(records)
    df = M.request_frame(records)
    for c in ("queue_time", "frontend_time", "ttft", "tpot", "e2el"):
        df[f"{c}_ms"] = df[c] * 1000.0
    mean_itl = []
    for r in records:
        tt = r.metrics.token_times
        mean_itl.append(((tt[-1] - tt[0]) / (len(tt) - 1) * 1000.0) if len(tt) >= 2 else float("nan"))
    if len(mean_itl) == len(df):
        df["mean_itl_ms"] = mean_itl
    return df


def metrics_csv(records: Iterable[RequestRecord], path: str | Path | None = None) -> str:
    records = list(records)
    text = metrics_frame(records).to_csv(index=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def steps_frame(snap: Snapshot) -> pd.DataFrame:
    """One row per step (data-parallel replicas: with each step's engine_index)."""
    rows = []
    for s in snap.steps:
        row = dict(engine_index=s.engine_index) if snap.num_replicas > 1 else {}
        row.update(step=s.step, start_s=s.start - snap.t0, duration_ms=(s.end - s.start) * 1e3,
                   num_seqs=len(s.scheduled), prefill_tokens=s.num_prefill_tokens, decode_tokens=s.num_decode_tokens,
                   running=s.num_running, waiting=s.num_waiting, kv_usage=s.kv_usage,
                   preempted=len(s.preempted), finished=len(s.finished), cuda_graph=s.cuda_graph,
                   prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits)
        row["timings_sampled"] = getattr(s, "timings_sampled", False)
        for k, v in (s.timings or {}).items():
            row[f"t_{k}_ms"] = v * 1e3
        for k, v in (getattr(s, "memory", None) or {}).items():
            row[f"mem_{k}"] = v
        rows.append(row)
    return pd.DataFrame(rows)


def chrome_trace(snap: Snapshot) -> dict:
    t0 = snap.t0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    n = snap.num_replicas
    ev: list[dict] = [
        dict(name="process_name", ph="M", pid=1, tid=0, args=dict(name="engine")),
        dict(name="process_sort_index", ph="M", pid=1, tid=0, args=dict(sort_index=0)),
    ]
    for r in range(n):
        who = f"replica {r} " if n > 1 else ""
        ev += [dict(name="thread_name", ph="M", pid=1, tid=2 * r + 1, args=dict(name=f"{who}steps")),
               dict(name="thread_name", ph="M", pid=1, tid=2 * r + 2,
                    args=dict(name=f"{who}forward regions (aggregated)"))]
    ev += [dict(name="process_name", ph="M", pid=2, tid=0, args=dict(name="requests")),
           dict(name="process_sort_index", ph="M", pid=2, tid=0, args=dict(sort_index=1))]
    for s in snap.steps:
        dur = max(0.0, (s.end - s.start) * 1e6)
        steps_tid, regions_tid = 2 * s.engine_index + 1, 2 * s.engine_index + 2
        who = f"replica {s.engine_index} " if n > 1 else ""
        ev.append(dict(name=f"step {s.step}", cat="step", ph="X", pid=1, tid=steps_tid, ts=us(s.start),
                       dur=round(dur, 3),
                       args=dict(seqs=len(s.scheduled), prefill_tokens=s.num_prefill_tokens,
                                 decode_tokens=s.num_decode_tokens, running=s.num_running, waiting=s.num_waiting,
                                 kv_usage=round(s.kv_usage, 4), preempted=s.preempted, finished=s.finished,
                                 cuda_graph=s.cuda_graph, spec=s.spec,
                                 requests=[f"{r.request_id}:{r.phase}:{r.num_tokens}" for r in s.scheduled[:64]])))
        tm = s.timings or {}
        cursor = s.start
        for k in _TOP_ORDER:
            if k not in tm:
                continue
            d = max(0.0, float(tm[k]))
            ev.append(dict(name=k, cat="region", ph="X", pid=1, tid=steps_tid, ts=us(cursor), dur=round(d * 1e6, 3)))
            if k in SUBREGIONS:
                sub_cursor = cursor
                for c in SUBREGIONS[k]:
                    if c in tm:
                        dc = max(0.0, float(tm[c]))
                        ev.append(dict(name=c, cat="region", ph="X", pid=1, tid=regions_tid, ts=us(sub_cursor),
                                       dur=round(dc * 1e6, 3), args=dict(aggregated_over_layers=True)))
                        sub_cursor += dc
            cursor += d
        ev.append(dict(name=f"{who}KV usage", ph="C", pid=1, tid=0, ts=us(s.end),
                       args={"%": round(100 * s.kv_usage, 2)}))
        ev.append(dict(name=f"{who}batch", ph="C", pid=1, tid=0, ts=us(s.end),
                       args=dict(running=s.num_running, waiting=s.num_waiting)))
        ev.append(dict(name=f"{who}tokens", ph="C", pid=1, tid=0, ts=us(s.start),
                       args=dict(prefill=s.num_prefill_tokens, decode=s.num_decode_tokens)))
    for i, r in enumerate(snap.requests, start=1):
        name = f"{r.request_id} (replica {r.engine_index})" if n > 1 else r.request_id
        ev.append(dict(name="thread_name", ph="M", pid=2, tid=i, args=dict(name=name)))
        ev.append(dict(name="thread_sort_index", ph="M", pid=2, tid=i, args=dict(sort_index=i)))
        for sp in r.spans:
            ev.append(dict(name=sp.phase + (f" ({sp.note})" if sp.note else ""), cat=sp.phase, ph="X", pid=2, tid=i,
                           ts=us(sp.start), dur=round(max(0.0, sp.end - sp.start) * 1e6, 3),
                           args=dict(request_id=r.request_id, tokens=sp.num_tokens,
                                     steps=f"{sp.step_start:.0f}-{sp.step_end:.0f}")))
        if r.finished is not None:
            ev.append(dict(name=r.status, ph="i", s="t", pid=2, tid=i, ts=us(r.finished),
                           args=dict(finish_reason=r.finish_reason, output_len=r.output_len,
                                     preemptions=r.num_preemptions)))
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"producer": "kvscope inspector", "t0_perf_counter": t0, "steps": len(snap.steps),
                          "requests": len(snap.requests)}}


def chrome_trace_json(snap: Snapshot, path: str | Path | None = None) -> str:
    text = json.dumps(chrome_trace(snap), default=str)
    if path is not None:
        Path(path).write_text(text)
    return text
