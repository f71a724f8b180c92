"""Structured output's token mask in one launch: the packed bitmask -> -inf on the disallowed logits.
(Its torch reference, the path of kernels="torch": engine.structured.bitmask.apply_token_bitmask_torch.)

Bit t of bitmask row i (word t // 32, bit t % 32) says whether token t is allowed for logits row rows[i];
tokens past the bitmask's last word (a vocabulary padded beyond the tokenizer's) are never allowed.
The torch path unpacks the bitmask into a [n, V] bool tensor and gathers / scatters the constrained rows
(about eight launches and several full-size temporaries); this kernel reads each 32-bit word once and
writes -inf straight into the disallowed entries of the constrained rows, leaving every other row alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, V, words, stride, BLOCK: tl.constexpr):
    """Program (i, chunk): tokens [chunk * BLOCK, (chunk + 1) * BLOCK) of logits row rows[i]."""
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = tl.load(bitmask_ptr + i.to(tl.int64) * words + offs // 32, mask=inside & (offs // 32 < words), other=0)
    allowed = ((word >> (offs % 32)) & 1) != 0             # arithmetic shift: the sign bit is bit 31, & 1 keeps one
    tl.store(logits_ptr + row * stride + offs, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=inside & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, block: int = 8192) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0.
    logits [B, V] (last dim contiguous), bitmask [n, words <= ceil(V / 32)] int32, rows [n] int32/int64
    (distinct), all on logits' device."""
    n = bitmask.shape[0]
    B, V = logits.shape
    assert logits.stride(-1) == 1 and bitmask.is_contiguous() and rows.shape == (n,)
    assert bitmask.shape[1] <= triton.cdiv(V, 32), (bitmask.shape, V)
    if n == 0:
        return
    block = min(block, triton.next_power_of_2(V))
    _apply_token_bitmask_kernel[(n, triton.cdiv(V, block))](logits, bitmask, rows, V, bitmask.shape[1],
                                                             logits.stride(0), BLOCK=block, num_warps=8)

