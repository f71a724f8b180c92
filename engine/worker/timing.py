"""Per-region timings of a step: perf_counter on CPU, CUDA events on GPU, nothing when disabled."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

_NULL = nullcontext()


class NullTimer:
    enabled = False

    def region(self, name: str):
        return _NULL

    def start_step(self):
        pass

    def collect(self) -> dict[str, float]:
        return {}


class CpuTimer(NullTimer):
    enabled = True

    def __init__(self):
        self._acc: dict[str, float] = defaultdict(float)

    def start_step(self):
        self._acc = defaultdict(float)

    @contextmanager
    def region(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._acc[name] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        return dict(self._acc)


class CudaTimer(NullTimer):
    """Records event pairs; `collect` (called after the step's host sync) sums their elapsed times."""
    enabled = True

    def __init__(self):
        self._pairs: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def start_step(self):
        self._pairs = []

    @contextmanager
    def region(self, name: str):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        try:
            yield
        finally:
            b.record()
            self._pairs.append((name, a, b))

    def collect(self) -> dict[str, float]:
        acc: dict[str, float] = defaultdict(float)
        if self._pairs:
            self._pairs[-1][2].synchronize()
        for name, a, b in self._pairs:
            acc[name] += a.elapsed_time(b) / 1000.0
        self._pairs = []
        return dict(acc)


def make_timer(enabled: bool, device: torch.device) -> NullTimer:
    if not enabled:
        return NullTimer()
    return CudaTimer() if device.type == "cuda" else CpuTimer()
