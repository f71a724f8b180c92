"""fused_linear (see gemv.py) over quantized weights: the small-batch decode linear reading 1 or 1/2 byte per
weight instead of 2, with the same RMSNorm / SiLU-mul prologues and residual epilogue.

Formats (engine/quant/formats.py): int8 per-channel (the row scale is applied once, after the dot), fp8
block-wise (each weight times its 128x128 block's scale as it is loaded), int4 group-wise (two codes per byte,
q * scale + min per 128-group; a byte tile covers two 64-wide halves of each group's activations).
Weight-only: activations stay in the model dtype and accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.formats import BLOCK, dequantize, int4_group
from . import torch_ops
from .gemv import PROLOGUES, _activation

FMT_IDS = {"int8": 0, "fp8": 1}


@triton.jit
def _w8_tile(w_rows, s_ptr, offs_n, offs_k, nm, K, stride_sn, FMT: tl.constexpr, BLOCK: tl.constexpr):
    """[BN, BK] fp32 weight tile: int8 codes (scaled later), or fp8 times its block scale."""
    wm = nm[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=wm, other=0.0).to(tl.float32)
    if FMT == 1:
        s = tl.load(s_ptr + (offs_n // BLOCK)[:, None] * stride_sn + (offs_k // BLOCK)[None, :], mask=wm, other=0.0)
        w = w * s
    return w


@triton.jit
def _gemv_w8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_rm, stride_om, eps,
                    FMT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                    USE_PDL: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm                  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1]
    offs_k = tl.arange(0, BLOCK_K)
    w = _w8_tile(w_rows, s_ptr, offs_n, offs_k, nm, K, stride_sn, FMT, BLOCK)  # fetched before the PDL wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a, ss = _activation(x_rows, nw_ptr, offs_k, mm, K, PROLOGUE, BLOCK_M)
    acc = tl.sum(a[:, None, :] * w[None, :, :], axis=2)                         # [BM, BN, BK] -> [BM, BN]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = _w8_tile(w_rows, s_ptr, offs_n, offs_k, nm, K, stride_sn, FMT, BLOCK)
        a, sq = _activation(x_rows, nw_ptr, offs_k, mm, K, PROLOGUE, BLOCK_M)
        acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
        ss += sq
    if FMT == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=nm, other=0.0)[None, :]   # per-channel scale
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    omask = mm[:, None] & nm[None, :]
    if HAS_RES:
        r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=omask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y, mask=omask)


@triton.jit
def _w4_tile(w_rows, s_rows, z_rows, offs_b, nm, NB, HALF: tl.constexpr):
    """[BN, BB] packed bytes -> (low, high) fp32 weight tiles; byte j is k = 2 HALF (j // HALF) + j % HALF (low)
    and that + HALF (high); its group is j // HALF."""
    bmask = nm[:, None] & (offs_b < NB)[None, :]
    b = tl.load(w_rows + offs_b[None, :], mask=bmask, other=0).to(tl.int32)
    grp = (offs_b // HALF)[None, :]
    s = tl.load(s_rows + grp, mask=bmask, other=0.0).to(tl.float32)
    z = tl.load(z_rows + grp, mask=bmask, other=0.0).to(tl.float32)
    return (b & 15).to(tl.float32) * s + z, (b >> 4).to(tl.float32) * s + z


@triton.jit
def _gemv_w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K, NB,
                    stride_xm, stride_wn, stride_sn, stride_rm, stride_om, eps,
                    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm                  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1] packed rows
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    z_rows = z_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    offs_b = tl.arange(0, BLOCK_B)
    w_lo, w_hi = _w4_tile(w_rows, s_rows, z_rows, offs_b, nm, NB, HALF)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    k_lo = (offs_b // HALF) * (2 * HALF) + offs_b % HALF
    a, ss = _activation(x_rows, nw_ptr, k_lo, mm, K, PROLOGUE, BLOCK_M)
    acc = tl.sum(a[:, None, :] * w_lo[None, :, :], axis=2)                      # [BM, BN]
    a, sq = _activation(x_rows, nw_ptr, k_lo + HALF, mm, K, PROLOGUE, BLOCK_M)
    acc += tl.sum(a[:, None, :] * w_hi[None, :, :], axis=2)
    ss += sq
    for b0 in range(BLOCK_B, NB, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        w_lo, w_hi = _w4_tile(w_rows, s_rows, z_rows, offs_b, nm, NB, HALF)
        k_lo = (offs_b // HALF) * (2 * HALF) + offs_b % HALF
        a, sq = _activation(x_rows, nw_ptr, k_lo, mm, K, PROLOGUE, BLOCK_M)
        acc += tl.sum(a[:, None, :] * w_lo[None, :, :], axis=2)
        ss += sq
        a, sq = _activation(x_rows, nw_ptr, k_lo + HALF, mm, K, PROLOGUE, BLOCK_M)
        acc += tl.sum(a[:, None, :] * w_hi[None, :, :], axis=2)
        ss += sq
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    omask = mm[:, None] & nm[None, :]
    if HAS_RES:
        r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=omask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y, mask=omask)


def quant_gemv_config(fmt: str, M: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K (int4: bytes per tile), num_warps): gemv.py's shapes at a similar byte count per tile
    (a 1-byte weight row of BLOCK_K k's is half the bytes of a bf16 one, so tiles run twice as wide in k)."""
    if K >= 4096:
        bn, bk, warps = 4, 4096, 8
    elif N <= K:
        bn, bk, warps = 4, 4096, 4
    else:
        bn, bk, warps = 4, 2048, 2
    if fmt == "int4":
        bk //= 2
    bm = triton.next_power_of_2(M)
    return bn, max(64, min(bk, triton.next_power_of_2(K), 8192 // (bm * bn))), warps


def quant_fused_linear(x: torch.Tensor, fmt: str, qt: dict[str, torch.Tensor], shape: tuple[int, int],
                       bias: torch.Tensor | None = None, *, prologue: str | None = None,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, pdl: bool = False,
                       config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] for silu_mul) -> [M, N] = prologue(x) @ W.T (+ bias) (+ residual), W the [N, K]
    weight the format's tensors qt stand for (engine/quant/formats.py). M is small (a decode step)."""
    M = x.shape[0]
    N, K = shape
    assert prologue in PROLOGUES and x.stride(-1) == 1
    assert x.shape[-1] == (2 * K if prologue == "silu_mul" else K), (x.shape, shape, prologue)
    assert prologue != "rms_norm" or norm_weight is not None
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if residual is not None:
        assert residual.shape == (M, N) and residual.stride(-1) == 1
    bn, bk, warps = config or quant_gemv_config(fmt, M, N, K)
    dummy = qt.get("weight", qt.get("qweight"))
    common = dict(PROLOGUE=PROLOGUES[prologue], HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                  USE_PDL=pdl, BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=bn, num_warps=warps,
                  num_stages=1, **({"launch_pdl": True} if pdl else {}))
    args_tail = (bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
                 residual if residual is not None else out, out)
    rs = residual.stride(0) if residual is not None else 0
    if fmt == "int4":
        w, s, z = qt["qweight"], qt["scales"], qt["mins"]
        _gemv_w4_kernel[(triton.cdiv(N, bn),)](
            x, w, s, z, *args_tail, M, N, K, w.shape[1], x.stride(0), w.stride(0), s.stride(0), rs,
            out.stride(0), eps, HALF=int4_group(qt) // 2, BLOCK_B=bk, **common)
    else:
        w = qt["weight"]
        s = qt["weight_scale"] if fmt == "int8" else qt["weight_scale_inv"]
        _gemv_w8_kernel[(triton.cdiv(N, bn),)](
            x, w, s, *args_tail, M, N, K, x.stride(0), w.stride(0), s.stride(0), rs, out.stride(0), eps,
            FMT=FMT_IDS[fmt], BLOCK=BLOCK, BLOCK_K=bk, **common)
    return out


def quant_fused_linear_ref(x, fmt, qt, shape, bias=None, *, prologue=None, norm_weight=None, eps=1e-6,
                           residual=None, pdl=False):
    """Dequantize, then the unfused torch composition."""
    w = dequantize(fmt, qt, shape, x.dtype)
    return torch_ops.fused_linear(x, w, bias, prologue=prologue, norm_weight=norm_weight, eps=eps,
                                  residual=residual)
