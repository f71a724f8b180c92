"""fused_linear (see gemv.py) over quantized weights: the small-batch decode linear reading 1 or 1/2 byte per
weight instead of 2, with the same RMSNorm / SiLU-mul prologues and residual epilogue.

Formats (engine/quant/formats.py): int8 per-channel (the row scale is applied once, after the dot), fp8
block-wise (each weight times its 128x128 block's scale as it is loaded), int4 group-wise (two codes per byte, a
tile is [rows, groups, bytes]: each group's scale and min multiply its partial dots once, not every weight).
Weight-only: activations stay in the model dtype and accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.formats import BLOCK, dequantize, int4_group
from . import torch_ops
from .gemv import PROLOGUES, _activation, _epilogue

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
    _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE, HAS_BIAS, HAS_RES)


@triton.jit
def _activation3(x_rows, nw_ptr, k3, mm, K, PROLOGUE: tl.constexpr):
    """_activation (gemv.py) over a [1, NG, H] block of k offsets: [BM, NG, H] fp32 tile and its rows' sums of
    squares (rms_norm; else zeros). x_rows [BM, 1, 1]."""
    xmask = mm[:, None, None] & (k3 < K)
    if PROLOGUE == 2:
        g = tl.load(x_rows + k3, mask=xmask, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + k3, mask=xmask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(x_rows.dtype.element_ty).to(tl.float32)
        sq = tl.zeros_like(tl.sum(tl.sum(a, axis=2), axis=1))
    else:
        a = tl.load(x_rows + k3, mask=xmask, other=0.0).to(tl.float32)
        sq = tl.sum(tl.sum(a * a, axis=2), axis=1)
        if PROLOGUE == 1:
            a = a * tl.load(nw_ptr + k3, mask=k3 < K, other=0.0).to(tl.float32)
    return a, sq


@triton.jit
def _w4_step(x_rows, nw_ptr, w_rows, s_rows, z_rows, g0, nm, mm, K, G, PROLOGUE: tl.constexpr,
             HALF: tl.constexpr, NG: tl.constexpr):
    """Groups [g0, g0 + NG) of BN rows: -> ([BM, BN] partial dot, [BM] sum of squares). A group's scale and min
    multiply its two partial dots (q . a) and sum(a) once, not every weight."""
    offs_g = g0 + tl.arange(0, NG)
    offs_h = tl.arange(0, HALF)
    gm = offs_g < G
    b = tl.load(w_rows + (offs_g[:, None] * HALF + offs_h[None, :])[None, :, :],
                mask=nm[:, None, None] & gm[None, :, None], other=0).to(tl.int32)        # [BN, NG, H] bytes
    s = tl.load(s_rows + offs_g[None, :], mask=nm[:, None] & gm[None, :], other=0.0).to(tl.float32)   # [BN, NG]
    z = tl.load(z_rows + offs_g[None, :], mask=nm[:, None] & gm[None, :], other=0.0).to(tl.float32)
    k3 = (offs_g[:, None] * (2 * HALF) + offs_h[None, :])[None, :, :]                    # [1, NG, H] low k's
    a_lo, sq_lo = _activation3(x_rows, nw_ptr, k3, mm, K, PROLOGUE)                      # [BM, NG, H]
    a_hi, sq_hi = _activation3(x_rows, nw_ptr, k3 + HALF, mm, K, PROLOGUE)
    qa = tl.sum(a_lo[:, None, :, :] * (b & 15).to(tl.float32)[None, :, :, :], axis=3) \
        + tl.sum(a_hi[:, None, :, :] * (b >> 4).to(tl.float32)[None, :, :, :], axis=3)  # [BM, BN, NG]
    sa = tl.sum(a_lo, axis=2) + tl.sum(a_hi, axis=2)                                    # [BM, NG]
    part = tl.sum(qa * s[None, :, :] + sa[:, None, :] * z[None, :, :], axis=2)         # [BM, BN]
    return part, sq_lo + sq_hi


@triton.jit
def _gemv_w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K, G,
                    stride_xm, stride_wn, stride_sn, stride_rm, stride_om, eps,
                    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm            # [BM, 1, 1]
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn            # [BN, 1, 1] packed rows
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn                  # [BN, 1]
    z_rows = z_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc, ss = _w4_step(x_rows, nw_ptr, w_rows, s_rows, z_rows, 0, nm, mm, K, G, PROLOGUE, HALF, NG)
    for g0 in range(NG, G, NG):
        part, sq = _w4_step(x_rows, nw_ptr, w_rows, s_rows, z_rows, g0, nm, mm, K, G, PROLOGUE, HALF, NG)
        acc += part
        ss += sq
    _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE, HAS_BIAS, HAS_RES)


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
        half = int4_group(qt) // 2
        _gemv_w4_kernel[(triton.cdiv(N, bn),)](
            x, w, s, z, *args_tail, M, N, K, s.shape[1], x.stride(0), w.stride(0), s.stride(0), rs,
            out.stride(0), eps, HALF=half, NG=max(1, bk // half), **common)
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
