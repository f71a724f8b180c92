"""The per-step token bitmask: bit t of row i (word t // 32, bit t % 32) = token t is allowed for row i.

It covers the tokenizer's vocabulary (GrammarCompiler.mask_vocab_size); the ids of a model vocabulary padded
beyond it are never allowed (llguidance itself is ~10x slower per token with a padded vocabulary).

llguidance fills the rows on the host (its own thread pool, GIL released; one row on the calling thread)
into a pinned buffer that also carries the logits-row index of each mask, so one host-to-device copy moves
both; then the disallowed logits of the constrained rows become -inf, in one Triton launch (`kernels.token_bitmask`) or, with
kernels="torch" / `EngineConfig.fused_token_bitmask=False`, through torch ops.
"""
from __future__ import annotations

import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class TokenBitmask:
    """A reusable host buffer (pinned on CUDA): n bitmask rows [n, words] then their n row indices, int32.
    Reuse is safe: the host fills it again only after waiting for tokens sampled behind the last copy."""

    def __init__(self, mask_vocab_size: int, device: torch.device, fused: bool = False, max_rows: int = 64,
                 threads: int | None = None):
        import llguidance
        self.device, self.fused = device, fused
        self.words = bitmask_words(mask_vocab_size)
        self.executor = llguidance.LLExecutor(threads)
        self.buf = self._alloc(max_rows)

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.empty(rows * (self.words + 1), dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def fill(self, matchers: list, rows: list[int]) -> torch.Tensor:
        """-> the host buffer's first n * (words + 1) words: bitmask row i for matchers[i]'s next token, then rows."""
        n, w = len(matchers), self.words
        if n * (w + 1) > self.buf.numel():
            self.buf = self._alloc(max(n, 2 * self.buf.numel() // (w + 1)))
        out = self.buf[:n * (w + 1)]
        if n == 1:                                  # on this thread: no pool wake-up for one row
            matchers[0].unsafe_compute_mask_ptr(out.data_ptr(), w * 4)
        else:   # what llguidance.torch.fill_next_token_bitmask_par does (that module torch.compiles at import)
            self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], out.data_ptr(), w * 4, n)
        out[n * w:] = torch.tensor(rows, dtype=torch.int32)
        return out

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, matchers: list, rows: list[int]) -> None:
        """In place: logits[rows[i], t] = -inf where matchers[i] forbids token t next. logits [B, V]."""
        self.apply_packed(logits, self.fill(matchers, rows).to(logits.device, non_blocking=True), len(matchers))

    @torch.inference_mode()
    def apply_packed(self, logits: torch.Tensor, packed: torch.Tensor, n: int) -> None:
        """In place, from n packed bitmask rows + their row indices on logits' device ([n * words + n])."""
        w = self.words
        bitmask, idx = packed[:n * w].view(n, w), packed[n * w:]
        if self.fused:
            from engine.kernels.token_bitmask import apply_token_bitmask
            apply_token_bitmask(logits, bitmask, idx)
        else:
            apply_token_bitmask_torch(logits, bitmask, None if n == logits.shape[0] else idx)


_BLOCKED: dict[torch.device, torch.Tensor] = {}     # per device: [256, 8] uint8, bit k of byte b is 0


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (torch ops; the reference of the
    Triton kernel). logits [B, V], bitmask [n, words <= ceil(V / 32)] int32 (tokens past its last word: never
    allowed), rows [n] distinct row indices, or None for every row in order (n = B)."""
    n, w = bitmask.shape
    V = logits.shape[1]
    table = _BLOCKED.get(bitmask.device)
    if table is None:
        table = _BLOCKED[bitmask.device] = (((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0).to(
            bitmask.device, torch.uint8)
    # little-endian words: byte j of word i holds tokens 32 i + 8 j ... + 7, lowest bit first
    blocked = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table)     # [n, 4 w, 8]
    blocked = blocked.view(n, w * 32)[:, :V].bool()                                    # [n, <= V]
    if blocked.shape[1] < V:
        blocked = torch.nn.functional.pad(blocked, (0, V - blocked.shape[1]), value=True)   # [n, V]
    if rows is None:
        logits.masked_fill_(blocked, float("-inf"))
        return
    rows = rows.long()
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(blocked, float("-inf")))
