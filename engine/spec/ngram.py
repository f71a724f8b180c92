"""N-gram (prompt lookup) drafting: no extra model.

The last n tokens (n from ngram_max down to ngram_min) are looked up in the request's own history
(prompt + generated); the tokens that followed their most recent earlier occurrence are the draft.
Drafts are deterministic, so verification treats q as one-hot.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..sequence import Sequence
from .base import Drafter


def ngram_propose(tokens: list[int] | np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = arr.shape[0]
    if k <= 0 or L < 2:
        return []
    # positions whose token equals the last one: candidate ends of a match (the suffix itself excluded)
    ends = np.flatnonzero(arr[:L - 1] == arr[L - 1])
    if ends.size == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        e = ends[ends >= n - 1]                        # a match of length n ending at e starts at e-n+1 >= 0
        if e.size == 0:
            continue
        if n > 1:
            win = sliding_window_view(arr, n)          # win[s] = arr[s:s+n]
            ok = (win[e - n + 1] == arr[L - n:]).all(1)
            e = e[ok]
            if e.size == 0:
                continue
        start = int(e[-1]) + 1                         # the most recent occurrence
        return arr[start:start + k].tolist()
    return []


class NgramDrafter(Drafter):
    method = "ngram"

    def __init__(self, engine):
        super().__init__(engine)
        cfg = engine.config
        self.n_min, self.n_max = cfg.ngram_min, cfg.ngram_max

    def draft(self, cands: list[tuple[Sequence, int]]) -> None:
        for seq, k in cands:
            seq.spec_token_ids = ngram_propose(seq.token_ids, self.n_min, self.n_max, k)
