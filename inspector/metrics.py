"""Serving metrics from the engine's RequestMetrics stamps, and only from those.

Definitions (the UI, the load summary, exports and benchmarks all use this module):
  TTFT   arrival -> first output token
  TPOT   (E2EL - TTFT) / (output tokens - 1): time per output token, first token excluded
  ITL    gap between consecutive streamed outputs (token_times); with speculative decoding a step
         can emit several tokens at once, so ITL != TPOT
  E2EL   arrival -> last token
  Throughput  completed requests (and their tokens) per second of the run's duration
  Goodput     completed requests per second that met every SLO that was set
Percentiles use linear interpolation (numpy's default, as `vllm bench serve`).
Latencies in the summary are in milliseconds; the per-request frame keeps seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from inspector.recorder import RequestRecord

METRIC_DEFINITIONS: dict[str, str] = {
    "TTFT": "Time to first token: arrival (at the server, load runner or playground, before tokenization) → "
            "first output token",
    "TPOT": "Time per output token, first token excluded: (E2EL − TTFT) / (output tokens − 1)",
    "ITL": "Inter-token latency: gap between consecutive streamed outputs (≠ TPOT when a step emits "
           "several tokens, e.g. speculative decoding)",
    "E2EL": "End-to-end latency: arrival → last token",
    "Request throughput": "Completed requests / run duration (first arrival → last token)",
    "Output throughput": "Generated tokens of completed requests / run duration",
    "Total throughput": "Prompt + generated tokens of completed requests / run duration",
    "Goodput": "Completed requests meeting every set SLO (TTFT, TPOT, E2EL) / run duration",
    "Preemptions": "Times a running request lost its KV blocks and went back to waiting (recompute)",
    "Prefix cache hit rate": "Prompt tokens served from the prefix cache / all prompt tokens",
}

LATENCY_METRICS = ("TTFT", "TPOT", "ITL", "E2EL")
PERCENTILES = (50, 90, 99)


@dataclass
class SLO:
    """Service-level objectives in milliseconds; None means not constrained."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self):
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, name)
            if v is not None and not (v > 0):
                raise ValueError(f"SLO.{name}: must be > 0 ms or empty (got {v!r})")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def _end_time(m) -> float | None:
    return m.last_token_time if m.last_token_time is not None else m.finished_time


def request_frame(records: Iterable[RequestRecord]) -> pd.DataFrame:
    """One row per request; times in seconds (perf_counter), latencies in seconds."""
    rows = []
    for r in records:
        m = r.metrics
        end = _end_time(m)
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        e2el = None if end is None else end - m.arrival_time
        tpot = None
        if r.output_len >= 2 and ttft is not None and e2el is not None:
            tpot = (e2el - ttft) / (r.output_len - 1)
        rows.append(dict(
            request_id=r.request_id, arrival=m.arrival_time, first_scheduled=m.first_scheduled_time,
            first_token=m.first_token_time, last_token=m.last_token_time, finished=m.finished_time,
            prompt_len=r.prompt_len, output_len=r.output_len, num_cached_tokens=m.num_cached_tokens,
            num_preemptions=m.num_preemptions, finish_reason=r.finish_reason,
            queue_time=(None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time),
            frontend_time=getattr(m, "frontend_time", None),
            ttft=ttft, tpot=tpot, e2el=e2el,
            num_outputs=len(m.token_times)))
    cols = ["request_id", "arrival", "first_scheduled", "first_token", "last_token", "finished",
            "prompt_len", "output_len", "num_cached_tokens", "num_preemptions", "finish_reason",
            "queue_time", "frontend_time", "ttft", "tpot", "e2el", "num_outputs"]
    df = pd.DataFrame(rows, columns=cols)
    for c in ("arrival", "first_scheduled", "first_token", "last_token", "finished", "queue_time",
              "frontend_time", "ttft", "tpot", "e2el"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    return df


def itl_values(records: Iterable[RequestRecord]) -> np.ndarray:
    """All inter-token latencies (seconds): gaps between consecutive output stamps of each request."""
    parts = [np.diff(np.asarray(r.metrics.token_times, dtype=np.float64))
             for r in records if len(r.metrics.token_times) >= 2]
    return np.concatenate(parts) if parts else np.zeros(0)


def stats(values: Sequence[float] | np.ndarray, scale: float = 1000.0) -> dict[str, float]:
    """mean / p50 / p90 / p99 / std / n of `values` (seconds), scaled (default to ms). NaNs are ignored."""
    v = pd.Series(np.asarray(values, dtype=np.float64)).dropna()
    if v.empty:
        return dict(n=0, mean=float("nan"), std=float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES})
    v = v * scale
    out = dict(n=int(v.size), mean=float(v.mean()), std=float(v.std(ddof=0)))
    for p in PERCENTILES:
        out[f"p{p}"] = float(v.quantile(p / 100.0, interpolation="linear"))
    return out


def completed(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.finish_reason not in ("abort", "aborted", "rejected", "error")
            and r.metrics.first_token_time is not None and _end_time(r.metrics) is not None]


def meets_slo(df: pd.DataFrame, slo: SLO | None) -> pd.Series:
    """Boolean per row: the request met every SLO that is set (TPOT is vacuous for 1-token outputs)."""
    ok = pd.Series(True, index=df.index)
    if slo is None:
        return ok
    if slo.ttft_ms is not None:
        ok &= df["ttft"] * 1000 <= slo.ttft_ms
    if slo.tpot_ms is not None:
        ok &= df["tpot"].isna() | (df["tpot"] * 1000 <= slo.tpot_ms)
    if slo.e2el_ms is not None:
        ok &= df["e2el"] * 1000 <= slo.e2el_ms
    return ok


def summarize(records: Iterable[RequestRecord], duration: float | None = None,
              slo: SLO | dict | None = None) -> dict:
    """The load-test summary. `duration` (s) defaults to first arrival -> last token of the records."""
    records = list(records)
    if isinstance(slo, dict):
        slo = SLO(**slo)
    done = completed(records)
    df = request_frame(done)
    if duration is None:
        if df.empty:
            duration = 0.0
        else:
            ends = df["last_token"].fillna(df["finished"])
            duration = float(ends.max() - df["arrival"].min())
    duration = float(duration)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: float("nan"))
    good = int(meets_slo(df, slo).sum()) if not df.empty else 0
    prompt_tokens = int(df["prompt_len"].sum()) if not df.empty else 0
    output_tokens = int(df["output_len"].sum()) if not df.empty else 0
    cached = int(df["num_cached_tokens"].sum()) if not df.empty else 0
    return dict(
        num_requests=len(records), completed=len(done), failed=len(records) - len(done),
        duration_s=duration, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        request_throughput=per_s(len(done)), output_throughput=per_s(output_tokens),
        total_throughput=per_s(prompt_tokens + output_tokens),
        goodput=per_s(good) if (slo is not None and slo.any) else None, good_requests=good,
        slo=None if slo is None else dict(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms, e2el_ms=slo.e2el_ms),
        preemptions=int(df["num_preemptions"].sum()) if not df.empty else 0,
        cached_tokens=cached, prefix_cache_hit_rate=(cached / prompt_tokens if prompt_tokens else 0.0),
        TTFT=stats(df["ttft"]), TPOT=stats(df["tpot"]), ITL=stats(itl_values(done)), E2EL=stats(df["e2el"]),
    )


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "—"
    return f"{x:,.{digits}f}"


def summary_table(summary: dict) -> pd.DataFrame:
    """A display table: latency rows with mean/p50/p90/p99 (ms), then throughput rows, each with its
    definition."""
    rows = []
    for name in LATENCY_METRICS:
        s = summary[name]
        rows.append({"Metric": f"{name} (ms)", "Mean": _fmt(s["mean"]), "P50": _fmt(s["p50"]),
                     "P90": _fmt(s["p90"]), "P99": _fmt(s["p99"]), "N": s["n"],
                     "Definition": METRIC_DEFINITIONS[name]})

    def single(name: str, value: str, n="") -> None:
        rows.append({"Metric": name, "Mean": value, "P50": "", "P90": "", "P99": "", "N": n,
                     "Definition": METRIC_DEFINITIONS.get(name.split(" (")[0], "")})

    single("Request throughput (req/s)", _fmt(summary["request_throughput"]), summary["completed"])
    single("Output throughput (tok/s)", _fmt(summary["output_throughput"], 1), summary["output_tokens"])
    single("Total throughput (tok/s)", _fmt(summary["total_throughput"], 1),
           summary["prompt_tokens"] + summary["output_tokens"])
    if summary.get("goodput") is not None:
        slo = summary.get("slo") or {}
        set_ = ", ".join(f"{k[:-3].upper()} ≤ {v:g} ms" for k, v in slo.items() if v is not None)
        rows.append({"Metric": "Goodput (req/s)", "Mean": _fmt(summary["goodput"]), "P50": "", "P90": "",
                     "P99": "", "N": summary["good_requests"],
                     "Definition": METRIC_DEFINITIONS["Goodput"] + (f" [{set_}]" if set_ else "")})
    single("Preemptions", str(summary["preemptions"]))
    single("Prefix cache hit rate (%)", _fmt(100 * summary["prefix_cache_hit_rate"], 1), summary["cached_tokens"])
    rows.append({"Metric": "Duration (s)", "Mean": _fmt(summary["duration_s"]), "P50": "", "P90": "", "P99": "",
                 "N": f"{summary['completed']}/{summary['num_requests']} completed",
                 "Definition": "First arrival → last token of the completed requests"})
    return pd.DataFrame(rows, columns=["Metric", "Mean", "P50", "P90", "P99", "N", "Definition"])


def request_stats(out) -> dict:
    """Per-request stats for the playground from one RequestOutput (ms, tok/s)."""
    m = out.metrics
    n = len(out.token_ids)
    end = _end_time(m) or m.first_token_time
    ttft = None if m.first_token_time is None else (m.first_token_time - m.arrival_time) * 1000
    e2el = None if end is None else (end - m.arrival_time) * 1000
    tpot = None
    if n >= 2 and m.first_token_time is not None and end is not None:
        tpot = (end - m.first_token_time) / (n - 1) * 1000
    gen_tps = (n - 1) / (end - m.first_token_time) if (n >= 2 and end and end > m.first_token_time) else None
    return dict(prompt_tokens=len(out.prompt_token_ids or []), output_tokens=n, ttft_ms=ttft, tpot_ms=tpot,
                e2el_ms=e2el, decode_tok_s=gen_tps, cached_tokens=m.num_cached_tokens,
                preemptions=m.num_preemptions, finish_reason=out.finish_reason)
