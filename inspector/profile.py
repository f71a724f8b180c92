"""Profile one engine step per kernel (torch.profiler), through the engine's optional hook.

The engine exposes `EngineLoop.profile_step(timeout)` / `LLMEngine.profile_step()` (the next step that runs
is profiled; its per-op table lands in `engine.last_profile` as dicts with name, count, cpu_time_ms,
device_time_ms). This wrapper waits until that table is really the new one, and returns None when the
engine has no such hook or no step ran in time.
"""
from __future__ import annotations

import time


def can_profile(loop) -> bool:
    return callable(getattr(loop, "profile_step", None)) or callable(getattr(getattr(loop, "engine", None),
                                                                            "profile_step", None))


def profile_one_step(loop, timeout: float = 15.0) -> list[dict] | None:
    if not can_profile(loop):
        return None
    eng = loop.engine
    before = getattr(eng, "last_profile", None)
    deadline = time.monotonic() + timeout
    rows = None
    if callable(getattr(loop, "profile_step", None)):
        rows = loop.profile_step(timeout=timeout)
        if rows is not None and rows is not before:     # a data-parallel loop profiles its busiest replica
            return rows
    else:
        loop.call(lambda e: e.profile_step(), timeout)
    while time.monotonic() < deadline:
        rows = getattr(eng, "last_profile", None)
        if rows is not None and rows is not before:
            return rows
        time.sleep(0.02)
    return None
