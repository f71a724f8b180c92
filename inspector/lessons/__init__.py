"""The lessons: seeded experiments that show, on the current model and device, why vLLM-style serving is fast.
Each module has `TITLE`, `WHAT` (one sentence: what its chart shows) and `run_lesson(Setup, ...) -> dict`
(plain JSON: series and a summary of measured ratios). Figures: `inspector.figures.lessons`; the same sweeps
as a script: `benchmarks/lessons.py`. No Gradio here."""
from __future__ import annotations

from inspector.lessons import batch_sweep, batching, chunked_prefill, kv_cache, kv_tiers, paging
from inspector.lessons.common import Setup

LESSONS = {"paging": paging, "kv_cache": kv_cache, "batching": batching, "batch_sweep": batch_sweep,
           "chunked_prefill": chunked_prefill, "kv_tiers": kv_tiers}


def run_lesson(name: str, setup: Setup, **kw) -> dict:
    if name not in LESSONS:
        raise ValueError(f"lesson: {name!r} is not one of {sorted(LESSONS)}")
    return LESSONS[name].run_lesson(setup, **kw)


__all__ = ["LESSONS", "Setup", "run_lesson"]
