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
def _gumbel_argmax_kernel(logits_ptr, temp_ptr, out_ptr, seed, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    greedy = t <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    noise = tl.where(greedy, 0.0, 1.0)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        u = tl.maximum(tl.rand(seed, row * V + offs), 1e-12)
        y = x * inv_t - noise * tl.log(-tl.log(u))                # logits / T + Gumbel(0, 1)
        upd = y > best_v                                          # strict: first index wins a tie
        best_v = tl.where(upd, y, best_v)
        best_i = tl.where(upd, offs, best_i)
    top = tl.max(best_v, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best_v == top, best_i, V), 0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """logits [B, V] (last dim contiguous), temperature [B] float32 (<= 0: greedy) -> token ids [B] int64.
    No host sync: the launch depends only on shapes and the seed."""
    B, V = logits.shape
    assert logits.stride(-1) == 1 and temperature.shape == (B,)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _gumbel_argmax_kernel[(B,)](logits, temperature, out, seed & 0x7FFFFFFF, V, logits.stride(0),
                                    BLOCK=1024, num_warps=4)
    return out


def gumbel_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
    """The torch law it must match: exponential race over softmax(logits / T); argmax for T <= 0."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = (logits.float() / t[:, None]).softmax(-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(greedy, logits.argmax(-1), (probs / q).argmax(-1))
