"""Fused residual add + RMSNorm: one program per row, fp32 math, one read of x/residual, one write each."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import torch_ops


@triton.jit
def add_residual_rstd(x_ptr, r_ptr, res_ptr, row, stride_x, stride_r, stride_res, offs, mask, N, eps,
                      HAS_RES: tl.constexpr):
    """Row `row` of x (+ residual, stored as the new residual) in fp32, and its 1 / RMS."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        xs = x.to(res_ptr.dtype.element_ty)                  # the new residual, rounded like torch's add
        tl.store(res_ptr + row * stride_res + offs, xs, mask=mask)
        x = xs.to(tl.float32)
    return x, tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, stride_x, stride_r, stride_o, stride_res,
                     N, eps, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x, rstd = add_residual_rstd(x_ptr, r_ptr, res_ptr, row, stride_x, stride_r, stride_res, offs, mask, N, eps,
                                HAS_RES)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w   # weight * norm(x).to(dtype), as torch
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] (last dim contiguous), residual like x or None -> (RMSNorm(x + residual) * weight, x + residual)."""
    shape, N = x.shape, x.shape[-1]
    x2 = x.reshape(-1, N)                                    # [T, N]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, N)
        res = torch.empty_like(out)
    else:
        r2 = res = x2                                        # unused by the kernel
    assert x2.stride(-1) == 1 and r2.stride(-1) == 1 and weight.is_contiguous()
    T = x2.shape[0]
    if T:
        BLOCK = triton.next_power_of_2(N)
        warps = min(16, max(1, BLOCK * x.element_size() // 512))   # ~16 bytes per thread per row
        _rms_norm_kernel[(T,)](x2, r2, weight, out, res, x2.stride(0), r2.stride(0), out.stride(0),
                               res.stride(0), N, eps, BLOCK=BLOCK, HAS_RES=residual is not None,
                               num_warps=warps)
    return out.view(shape), (res.view(shape) if residual is not None else x)


@triton.jit(do_not_specialize=["T"])                        # run-time size: no recompile per token count
def _head_rms_norm_kernel(x_ptr, w_ptr, T, stride_t, stride_h, eps,
                          D: tl.constexpr, BD: tl.constexpr, BLOCK_T: tl.constexpr):
    # x [T, nH, D] (a strided view, D contiguous), normalized in place; program (token block, head)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.arange(0, BD)
    mask = (rows < T)[:, None] & (offs < D)[None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_t + tl.program_id(1) * stride_h + offs[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)                # [BLOCK_T, BD]
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    y = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(ptrs, y.to(x_ptr.dtype.element_ty), mask=mask)


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm (Qwen3's q/k norm) of x [T, nH, D] in place, on the q/k views of the packed qkv output
    (no copy to make them contiguous; a tile of tokens per program, not one short row per program)."""
    T, nH, D = x.shape
    assert x.stride(2) == 1 and weight.is_contiguous()
    if T:
        BD = triton.next_power_of_2(D)
        BLOCK_T = max(1, min(32, 4096 // BD))                 # fixed per head size: one compile
        _head_rms_norm_kernel[(triton.cdiv(T, BLOCK_T), nH)](x, weight, T, x.stride(0), x.stride(1), eps,
                                                             D=D, BD=BD, BLOCK_T=BLOCK_T, num_warps=4)
    return x


def rms_norm_ref(x, weight, eps, residual=None):
    return torch_ops.rms_norm(x, weight, eps, residual)
