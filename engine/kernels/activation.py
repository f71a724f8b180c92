"""silu(gate) * up over [T, 2I] -> [T, I], fp32 math, one pass."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import torch_ops


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (last dim contiguous) -> [..., I]."""
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)                                # [T, 2I]
    assert x2.stride(-1) == 1
    out = torch.empty((x2.shape[0], I), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        BLOCK = min(2048, triton.next_power_of_2(I))
        warps = min(8, max(1, BLOCK * x.element_size() // 512))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, BLOCK))](
            x2, out, x2.stride(0), out.stride(0), I, BLOCK=BLOCK, num_warps=warps)
    return out.view(*x.shape[:-1], I)


def silu_and_mul_ref(x):
    return torch_ops.silu_and_mul(x)
