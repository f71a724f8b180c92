"""Arrival processes, as in `vllm bench serve`: gamma inter-arrival times with shape k = burstiness and
scale 1 / (rate * k), so the mean rate is `rate` for every k; k = 1 is a Poisson process, k < 1 is burstier,
k > 1 more regular. rate = inf sends everything at once."""
from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int | None = 0) -> np.ndarray:
    """Arrival offsets (s) of n requests: the first at 0, then gamma(k=burstiness, scale=1/(rate*k)) gaps."""
    if n <= 0:
        return np.zeros(0)
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 requests/s (got {rate!r})")
    if not burstiness > 0:
        raise ValueError(f"burstiness: must be > 0 (got {burstiness!r})")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
