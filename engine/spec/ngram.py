"""N-gram (prompt lookup) drafting: no extra model.

The last n tokens (n from ngram_max down to ngram_min) are looked up in the request's own history
(prompt + generated); the tokens that followed their most recent earlier occurrence are the draft.
Drafts are deterministic, so verification treats q as one-hot.

Each request keeps an index of its history: per n, a dict from each n-gram to the end position of its most
recent occurrence, extended by the tokens added since the last step (C-speed `dict.update` over zipped
slices), so a proposal is at most (ngram_max - ngram_min + 1) dict lookups instead of a scan of the history.
`ngram_propose` is the scan it must agree with (tests/test_spec_host.py), and serves histories longer than
`INDEX_MAX_TOKENS`, where the index would cost ~0.5 KB per token.
"""
from __future__ import annotations

import numpy as np

from engine.core.sequence import Sequence
from engine.spec.base import Drafter


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


INDEX_MAX_TOKENS = 16384     # longer histories are scanned (ngram_propose) instead of indexed


class NgramIndex:
    """One request's n-grams (n_min..n_max) -> end position of their most recent occurrence, over the ends
    0 .. L-2 of its token history (the suffix itself is never a match of itself)."""
    __slots__ = ("n_min", "n_max", "tables", "ends")

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tables: list[dict[tuple, int]] = [{} for _ in range(n_max + 1)]    # [n]: n-gram -> last end
        self.ends = 0                       # ends 0 .. ends-1 are indexed

    def _extend(self, tokens: list[int], hi: int) -> None:
        """Index the n-grams ending at positions self.ends .. hi - 1."""
        lo, tables = self.ends, self.tables
        if hi - lo <= 32:                           # a step's few new tokens: plain lookups are cheapest
            for n in range(self.n_min, self.n_max + 1):
                t = tables[n]
                for e in range(max(lo, n - 1), hi):
                    t[tuple(tokens[e - n + 1:e + 1])] = e
        else:                                       # a prompt: zipped slices, at C speed per n-gram
            for n in range(self.n_min, self.n_max + 1):
                e0 = max(lo, n - 1)                 # first end with n tokens before it
                if e0 >= hi:
                    continue
                m = hi - e0                         # n-grams ending at e0 .. hi-1
                seg = tokens[e0 - n + 1:hi]
                tables[n].update(zip(zip(*[seg[j:j + m] for j in range(n)]), range(e0, hi)))  # latest end wins
        self.ends = hi

    def propose(self, tokens: list[int], k: int, L: int | None = None) -> list[int]:
        """As ngram_propose(tokens[:L], n_min, n_max, k) (L: the whole history) for a history prefix that only
        grew since the last call. L < len(tokens): a shadow probe, the draft the proposer would have made when
        the history was L tokens long."""
        if L is None:
            L = len(tokens)
        if L < self.ends + 1:                       # the history shrank (never for a live request): re-index
            self.tables, self.ends = [{} for _ in range(self.n_max + 1)], 0
        if k <= 0 or L < 2:
            return []
        if self.ends < L - 1:
            self._extend(tokens, L - 1)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            end = self.tables[n].get(tuple(tokens[L - n:L]))
            if end is not None:
                return tokens[end + 1:min(end + 1 + k, L)]
        return []


class _History:
    """A long request's tokens as a growing numpy array (amortised O(1) append), so each scan converts only the
    tokens added since the last one."""
    __slots__ = ("buf", "n")

    def __init__(self):
        self.buf, self.n = np.empty(256, dtype=np.int64), 0

    def propose(self, tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
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
        return ngram_propose(self.buf[:L], n_min, n_max, k)


class NgramDrafter(Drafter):
    method = "ngram"
    supports_shadow = True
    supports_long = True

    def __init__(self, engine):
        super().__init__(engine)
        cfg = engine.config
        self.n_min, self.n_max = cfg.speculative_config.ngram_min, cfg.speculative_config.ngram_max
        self._index: dict[str, NgramIndex | _History] = {}      # _History: too long to index, scanned instead
        self.prefetch_prompts = cfg.speculative_config.spec_prefetch

    def draft(self, cands: list[tuple[Sequence, int]]) -> None:
        if len(self._index) > 2 * len(cands) + 256:
            live = {s.request_id for s in self.engine.scheduler.running}
            self._index = {r: h for r, h in self._index.items() if r in live}
        index = self._index
        for seq, k in cands:
            toks = seq.token_ids
            ix = index.get(seq.request_id)
            if len(toks) > INDEX_MAX_TOKENS:
                if not isinstance(ix, _History):
                    ix = index[seq.request_id] = _History()
                seq.spec_token_ids = ix.propose(toks, k, self.n_min, self.n_max)
                continue
            if not isinstance(ix, NgramIndex):
                ix = index[seq.request_id] = NgramIndex(self.n_min, self.n_max)
            seq.spec_token_ids = ix.propose(toks, k)

    def prefetch(self, sched) -> None:
        """Index each prompt whose last chunk this step computes, so the first proposal after it (a pipeline
        start, with the device idle) is a few lookups (EngineConfig.spec_prefetch)."""
        if not self.prefetch_prompts:
            return
        for seq, n, start in zip(sched.seqs, sched.num_new_tokens, sched.computed_before):
            P = seq.num_prompt_tokens
            if start < P <= start + n and P <= INDEX_MAX_TOKENS:
                ix = self._index.get(seq.request_id)
                if not isinstance(ix, NgramIndex):
                    ix = self._index[seq.request_id] = NgramIndex(self.n_min, self.n_max)
                if ix.ends < P:
                    ix._extend(seq.token_ids, P)

    def shadow_draft(self, seq: Sequence, lo: int, hi: int, k: int) -> tuple[int, list[int]] | None:
        """The first history length L in [lo, hi] at which the proposer finds a draft (of at most k tokens), as it
        would have drafted then: (L, draft), or None. Lengths the index has already passed are skipped; a
        history too long to index is looked at only at hi (one scan)."""
        toks = seq.token_ids
        ix = self._index.get(seq.request_id)
        if len(toks) > INDEX_MAX_TOKENS:
            d = ngram_propose(toks[:hi], self.n_min, self.n_max, k)
            return (hi, d) if d else None
        if not isinstance(ix, NgramIndex):
            ix = self._index[seq.request_id] = NgramIndex(self.n_min, self.n_max)
        for L in range(max(lo, ix.ends + 1, 2), hi + 1):
            d = ix.propose(toks, k, L)
            if d:
                return L, d
        return None
