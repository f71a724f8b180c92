"""int32 counters a kernel's programs count their arrivals on, the last to arrive doing a step for all of them
(a merge of split-K partials, a sampler's reduction over vocabulary chunks) and zeroing its counter again."""
from __future__ import annotations

import torch

_POOLS: dict = {}


def zeroed_counters(pool: str, device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros of the pool (one per kernel kind, so two kinds never share a counter). Buffers are
    never freed: captured graphs hold their addresses; a larger need allocates a new one. Launches using one pool
    on one device must not run concurrently on two streams."""
    key = (pool, torch.device(device))
    bufs = _POOLS.get(key)
    if bufs is None or bufs[-1].numel() < n:
        size = max(n, 4096 if key[1].type == "cuda" else n)
        _POOLS[key] = bufs = (bufs or []) + [torch.zeros(size, dtype=torch.int32, device=key[1])]
    return bufs[-1]
