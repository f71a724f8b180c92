"""N-gram (prompt lookup) drafting: no extra model.

The last n tokens (n from ngram_max down to ngram_min) are looked up in the request's own history
(prompt + generated); the tokens that followed their most recent earlier occurrence are the draft.
Drafts are deterministic, so verification treats q as one-hot.
"""
from __future__ import annotations

import numpy as np

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
    # each candidate's match length (capped at n_max), extended one token back at a time while it still matches
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(n_max, L - 1)):
        back = ends - j
        alive &= (back >= 0) & (arr[np.maximum(back, 0)] == arr[L - 1 - j])
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < n_min:
        return []
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1      # the most recent longest match
    return arr[start:start + k].tolist()


class _History:
    """A request's tokens as a growing numpy array (amortised O(1) append), so a step converts only the tokens
    added since the last one instead of the whole history."""
    __slots__ = ("buf", "n")

    def __init__(self):
        self.buf, self.n = np.empty(256, dtype=np.int64), 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        L = len(tokens)
        if L < self.n:                                 # never happens for a live request; stay correct anyway
            self.n = 0
        if L > self.buf.shape[0]:
            grown = np.empty(max(L, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if L > self.n:
            self.buf[self.n:L] = tokens[self.n:L]
            self.n = L
        return self.buf[:L]


class NgramDrafter(Drafter):
    method = "ngram"

    def __init__(self, engine):
        super().__init__(engine)
        cfg = engine.config
        self.n_min, self.n_max = cfg.ngram_min, cfg.ngram_max
        self._hist: dict[str, _History] = {}

    def draft(self, cands: list[tuple[Sequence, int]]) -> None:
        if len(self._hist) > 2 * len(cands) + 256:
            live = {s.request_id for s in self.engine.scheduler.running}
            self._hist = {r: h for r, h in self._hist.items() if r in live}
        for seq, k in cands:
            h = self._hist.get(seq.request_id)
            if h is None:
                h = self._hist[seq.request_id] = _History()
            seq.spec_token_ids = ngram_propose(h.sync(seq.token_ids), self.n_min, self.n_max, k)
