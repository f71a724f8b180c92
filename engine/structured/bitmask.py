"""The per-step token bitmask: bit t of row r (word t // 32, bit t % 32) = token t is allowed for row r.

llguidance fills the rows on the host (its own thread pool, GIL released); `apply_token_bitmask` sets
the logits of disallowed tokens to -inf on the constrained rows only.
"""
from __future__ import annotations

import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class TokenBitmask:
    """A reusable host buffer [max_rows, words] (pinned on CUDA) and the llguidance executor that fills it.
    Reuse is safe: a step's sampling reads its tokens back to the host before the next step fills it."""

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int = 64):
        import llguidance
        self.vocab_size, self.device = vocab_size, device
        self.executor = llguidance.LLExecutor()
        self.buf = self._alloc(max_rows)

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, bitmask_words(self.vocab_size), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")

    def fill(self, matchers: list) -> torch.Tensor:
        """-> the bitmask [len(matchers), words] (host), row i for matchers[i]'s next token."""
        n = len(matchers)
        if n > self.buf.shape[0]:
            self.buf = self._alloc(max(n, 2 * self.buf.shape[0]))
        out = self.buf[:n]
        # what llguidance.torch.fill_next_token_bitmask_par does (that module torch.compiles at import: seconds)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.data_ptr(),
                                              out.shape[1] * 4, n)
        return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, words] int32 -> [n, vocab_size] bool (True = allowed)."""
    n, w = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                 # [n, words, 32]
    return bits.view(n, w * 32)[:, :vocab_size].bool()


@torch.inference_mode()
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0. logits [B, V], bitmask [n, words]
    on the host or the device; rows: n distinct row indices."""
    B, V = logits.shape
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), V)    # [n, V]
    if len(rows) == B and rows == list(range(B)):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(~allowed, float("-inf")))
