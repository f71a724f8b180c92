"""Temperature sampling in one pass over the logits: argmax(logits / T + Gumbel noise) per row.

The Gumbel-max trick draws exactly from softmax(logits / T) (the same law as the exponential race
argmax(p / Exp(1)) of the torch reference), reading each logit once instead of the five passes of
divide, softmax, draw, divide and argmax. Rows with T <= 0 take the plain argmax (greedy). Noise comes
from Philox (tl.rand) keyed by (seed, row, token), so a launch depends only on its seed argument.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seed"])
def _gumbel_argmax_kernel(logits_ptr, temp_ptr, val_ptr, idx_ptr, seed, V, stride, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Program (row, chunk): the best of logits / T + Gumbel over one CHUNK of the vocabulary."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    greedy = t <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    noise = tl.where(greedy, 0.0, 1.0)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        u = tl.maximum(tl.rand(seed, row * V + offs), 1e-12)
        y = x * inv_t - noise * tl.log(-tl.log(u))                # logits / T + Gumbel(0, 1)
        upd = y > best_v                                          # strict: first index wins a tie
        best_v = tl.where(upd, y, best_v)
        best_i = tl.where(upd, offs, best_i)
    top = tl.max(best_v, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(val_ptr + out, top)
    tl.store(idx_ptr + out, tl.min(tl.where(best_v == top, best_i, V), 0))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int, chunk: int = 8192) -> torch.Tensor:
    """logits [B, V] (last dim contiguous), temperature [B] float32 (<= 0: greedy) -> token ids [B] int64.
    Grid (B, V / chunk) fills the chip even at small B; the per-chunk winners are reduced in torch.
    No host sync: the launch depends only on shapes and the seed."""
    B, V = logits.shape
    assert logits.stride(-1) == 1 and temperature.shape == (B,)
    if B == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    block = min(1024, triton.next_power_of_2(V))
    chunk = max(block, min(chunk, triton.next_power_of_2(V)) // block * block)
    n = triton.cdiv(V, chunk)
    vals = torch.empty((B, n), dtype=torch.float32, device=logits.device)
    idx = torch.empty((B, n), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(B, n)](logits, temperature, vals, idx, seed & 0x7FFFFFFF, V, logits.stride(0),
                                  CHUNK=chunk, BLOCK=block, num_warps=4)
    best = vals.argmax(1, keepdim=True)                           # first chunk wins a tie
    return idx.gather(1, best).squeeze(1).long()


def gumbel_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
    """The torch law it must match: exponential race over softmax(logits / T); argmax for T <= 0."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = (logits.float() / t[:, None]).softmax(-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(greedy, logits.argmax(-1), (probs / q).argmax(-1))
