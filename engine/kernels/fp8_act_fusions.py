"""The ops before an FP8 GEMM with their output quantized in the same kernel (EngineConfig.fp8_act_fusion):
residual add + RMSNorm (before q/k/v and gate/up) and SiLU-and-mul (before down) write the fp8 codes and the
per-token 128-group scales that kernels/quant_gemm_fp8.py's GEMMs read, instead of bf16 activations that a
separate launch then quantizes. The output is first rounded to the activation dtype, as the unfused ops store
it, so codes and scales are bit-identical to rms_norm / silu_and_mul followed by quantize_activations_fp8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.formats import BLOCK, FP8_MAX
from engine.kernels.quant_gemm_fp8 import fp8_act_buffers
from engine.kernels.rmsnorm import add_residual_rstd


class Fp8Act:
    """Activations already quantized for the FP8 GEMM: q [Mp, K] fp8, s [Mp, K / 128] (column-major), of which
    the first `rows` are real (Mp: rows rounded up for cuBLAS); dtype: what the unquantized activations were."""
    __slots__ = ("q", "s", "rows", "dtype")

    def __init__(self, q: torch.Tensor, s: torch.Tensor, rows: int, dtype: torch.dtype):
        self.q, self.s, self.rows, self.dtype = q, s, rows, dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.q.shape[1]


@triton.jit
def _quantize_groups(y, G: tl.constexpr, GROUP: tl.constexpr, FMAX: tl.constexpr):
    """y [G * GROUP] fp32 -> (codes [G, GROUP] fp32 before the cast, scales [G]); true divisions, as
    quantize_activations_fp8."""
    yg = tl.reshape(y, (G, GROUP))
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(yg), axis=1), 1e-12), FMAX)
    return tl.div_rn(yg, s[:, None]), s


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_ptr, M, stride_x, stride_r, stride_q, stride_sk,
                         stride_res, N, eps, HAS_RES: tl.constexpr, FMAX: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    live = offs * 0 + row < M                               # [BLOCK_N]; rows M.. pad for cuBLAS: zero codes
    x, rstd = add_residual_rstd(x_ptr, r_ptr, res_ptr, row, stride_x, stride_r, stride_res, offs, live, N, eps,
                                HAS_RES)
    w = tl.load(w_ptr + offs).to(tl.float32)
    y = ((x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    q, s = _quantize_groups(y, BLOCK_N // GROUP, GROUP, FMAX)
    tl.store(q_ptr + row * stride_q + tl.reshape(offs, (BLOCK_N // GROUP, GROUP)), q.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + tl.arange(0, BLOCK_N // GROUP) * stride_sk + row, s)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, M, stride_x, stride_q, stride_sk, I, FMAX: tl.constexpr,
                             BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = offs * 0 + row < M                               # [BLOCK_N]
    gate = tl.load(x_ptr + row * stride_x + offs, mask=live, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=live, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    q, s = _quantize_groups(y, BLOCK_N // GROUP, GROUP, FMAX)
    tl.store(q_ptr + row * stride_q + tl.reshape(offs, (BLOCK_N // GROUP, GROUP)), q.to(q_ptr.dtype.element_ty))
    groups = tl.program_id(1) * (BLOCK_N // GROUP) + tl.arange(0, BLOCK_N // GROUP)
    tl.store(s_ptr + groups * stride_sk + row, s)


def rms_norm_fusable(hidden: int) -> bool:
    """rms_norm_fp8 normalizes a row in one power-of-two block of whole 128-groups."""
    return hidden % BLOCK == 0 and hidden & (hidden - 1) == 0 and hidden <= 16384


def _silu_block(inter: int) -> int:
    return min(2048, inter & -inter)                # the largest power of two (<= 2048) dividing the width


def silu_fusable(inter: int) -> bool:
    """silu_and_mul_fp8 takes blocks of whole 128-groups that tile the intermediate width."""
    return inter % BLOCK == 0 and _silu_block(inter) >= BLOCK


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 row_align: int = 1) -> tuple[Fp8Act, torch.Tensor]:
    """rms_norm's contract (kernels/rmsnorm.py) with the normalized rows quantized for the FP8 GEMM:
    x [M, N] -> (Fp8Act of RMSNorm(x + residual) * weight, x + residual)."""
    M, N = x.shape
    assert rms_norm_fusable(N) and x.stride(-1) == 1 and weight.is_contiguous()
    Mp, q, s = fp8_act_buffers(M, N, row_align, x.device)
    res = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    assert r.stride(-1) == 1
    if Mp:
        _rms_norm_fp8_kernel[(Mp,)](x, r, weight, q, s, res, M, x.stride(0), r.stride(0), q.stride(0), s.stride(0),
                                    res.stride(0), N, eps, HAS_RES=residual is not None, FMAX=FP8_MAX, BLOCK_N=N,
                                    GROUP=BLOCK, num_warps=min(16, max(1, N * x.element_size() // 512)))
    return Fp8Act(q, s.t(), M, x.dtype), res


def silu_and_mul_fp8(x: torch.Tensor, row_align: int = 1) -> Fp8Act:
    """silu_and_mul's contract (kernels/activation.py), x [M, 2I] -> Fp8Act of [M, I], quantized for the FP8 GEMM."""
    M, I = x.shape[0], x.shape[1] // 2
    assert silu_fusable(I) and x.stride(-1) == 1
    Mp, q, s = fp8_act_buffers(M, I, row_align, x.device)
    if Mp:
        bn = _silu_block(I)
        _silu_and_mul_fp8_kernel[(Mp, I // bn)](x, q, s, M, x.stride(0), q.stride(0), s.stride(0), I, FMAX=FP8_MAX,
                                                BLOCK_N=bn, GROUP=BLOCK, num_warps=min(8, max(1, bn * 2 // 512)))
    return Fp8Act(q, s.t(), M, x.dtype)
