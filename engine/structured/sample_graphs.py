"""One CUDA graph per grammar iteration's sampling (EngineConfig.structured_sample_graphs): the copy of the
mask rows to the device, the mask, the Gumbel-max sampler and the copy of the tokens back, replayed as one
launch instead of about a dozen (each Triton launch costs ~50 µs of host time on the H200's host, and in a
grammar block the host's work per token is what the GPU waits for).

A graph reads one pinned host buffer per entry, [n * words masks | n row indices | seed | B temperatures
(float32 bits)], so a replay needs only the masks filled and the seed written. Entries are keyed by the
logits buffer (a decode graph's static output), the batch and the constrained rows. The seeds are those the
ungraphed sampler draws (`sampler._philox_seed`, one per iteration), so the tokens are the same.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..kernels.sampling import gumbel_sample
from ..kernels.token_bitmask import apply_token_bitmask
from ..sampler import SampleRow, _philox_seed


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    host: torch.Tensor          # pinned int32 [n * words + n + 1 + B]
    tokens: torch.Tensor        # device int64 [B], the graph's output
    host_tokens: torch.Tensor   # pinned int64 [B]
    temps: list[float] | None = None


class _Tokens:
    """The HostCopy interface over an entry's pinned token buffer (valid until the entry's next replay)."""

    def __init__(self, entry: _Entry):
        self.host, self.event = entry.host_tokens, torch.cuda.Event()
        self.event.record()

    def tolist(self) -> list:
        self.event.synchronize()
        return self.host.tolist()


def graphable(rows: list[SampleRow]) -> bool:
    """Rows the one-kernel sampler draws exactly as the engine's sampler would: temperature only (or greedy),
    no seed, no bans, penalties or logprobs."""
    return all(not r.banned and r.params.logprobs is None and not r.params.needs_penalties
               and (r.params.greedy or (r.params.seed is None and r.params.top_k <= 0 and r.params.top_p >= 1.0
                                        and r.params.min_p <= 0)) for r in rows)


class GrammarSampleGraphs:
    def __init__(self, words: int, max_entries: int = 16):
        self.words, self.max_entries = words, max_entries
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.num_captured = 0

    def sample(self, tb, logits: torch.Tensor, matchers: list, cons: list[int], rows: list[SampleRow],
               generator: torch.Generator | None) -> tuple[torch.Tensor, _Tokens]:
        """Fill the masks of matchers (logits rows cons) and replay -> (token ids [B] on the device, a copy of
        them on the way to the host). logits [B, V] must be a buffer that outlives the entry (a graph output)."""
        B, n, w = logits.shape[0], len(cons), self.words
        key = (logits.data_ptr(), B, tuple(cons))
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = self._capture(logits, cons)
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        temps = [0.0 if r.params.greedy else r.params.temperature for r in rows]
        if temps != e.temps:
            e.host[n * w + n + 1:].view(torch.float32)[:] = torch.tensor(temps, dtype=torch.float32)
            e.temps = temps
        tb.fill_slot(matchers, e.host[:n * w])
        e.host[n * w + n] = _philox_seed(generator) & 0x7FFFFFFF
        e.graph.replay()
        return e.tokens.clone(), _Tokens(e)

    def _capture(self, logits: torch.Tensor, cons: list[int]) -> _Entry:
        B, n, w = logits.shape[0], len(cons), self.words
        host = torch.zeros(n * w + n + 1 + B, dtype=torch.int32, pin_memory=True)
        host[n * w:n * w + n] = torch.tensor(cons, dtype=torch.int32)
        dev = torch.empty_like(host, device=logits.device)
        host_tokens = torch.empty(B, dtype=torch.int64, pin_memory=True)
        saved = logits.clone()                      # the capture's warm-up run writes -inf into them

        def body():
            dev.copy_(host, non_blocking=True)
            apply_token_bitmask(logits, dev[:n * w].view(n, w), dev[n * w:n * w + n])
            toks = gumbel_sample(logits, dev[n * w + n + 1:].view(torch.float32), 0,
                                 seed_tensor=dev[n * w + n:n * w + n + 1])
            host_tokens.copy_(toks, non_blocking=True)
            return toks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):               # compile and allocate outside the capture
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens = body()
        logits.copy_(saved)
        self.num_captured += 1
        return _Entry(graph, host, tokens, host_tokens)
