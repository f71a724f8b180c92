"""Quantized-weight GEMM for steps of more than a few tokens (prefill chunks, large decode batches): x @ W.T
with W dequantized tile by tile inside the kernel, so only the quantized bytes leave HBM.

One K step is one 128-wide block (fp8) or group (int4), so a block's scale multiplies a whole partial dot:
- int8: int8 codes -> activation dtype (exact), dot, the per-channel scale once at the end;
- fp8 weight-only: fp8 codes -> activation dtype (exact), dot * the [BN] block scales of this k-block;
- int4: a group's 64 bytes are its low and high halves; q * scale + min -> activation dtype, two dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.formats import BLOCK, dequantize, int4_group, quantize_activations_fp8_ref

FMT_IDS = {"int8": 0, "fp8": 1}


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b; fp32 operands in full fp32 (IEEE) rather than TF32, as torch's fp32 matmul."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _gemm_w8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm                  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        km = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mm[:, None] & km[None, :], other=0.0)        # [BM, BK]
        w = tl.load(w_rows + offs_k[None, :], mask=nm[:, None] & km[None, :], other=0.0)        # [BN, BK]
        if FMT == 0:
            acc += _dot(a, tl.trans(w.to(a.dtype)), IEEE)
        else:
            ws = tl.load(s_ptr + (offs_n // BLOCK_K) * stride_sn + k0 // BLOCK_K, mask=nm, other=0.0)  # [BN]
            acc += _dot(a, tl.trans(w.to(a.dtype)), IEEE) * ws[None, :]
    if FMT == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=nm, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _join8(t0, t1, t2, t3, t4, t5, t6, t7):
    """8 tensors [..., S] -> [..., 8 S] (an interleave; the same for weights and k offsets, so the dot is right)."""
    t = tl.join(tl.join(tl.join(t0, t1), tl.join(t2, t3)), tl.join(tl.join(t4, t5), tl.join(t6, t7)))
    return tl.reshape(t, (t0.shape[0], 8 * t0.shape[1]))


@triton.jit
def _dq(b, SH: tl.constexpr, s, z, a):
    """The nibbles at bit SH of words b, times the scale plus the min, in a's dtype."""
    return (((b >> SH) & 15).to(tl.float32) * s + z).to(a.dtype)


@triton.jit
def _gemm_w4_words_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, G, stride_xm, stride_wn, stride_sn,
                          stride_om, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, S: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOTS: tl.constexpr = False):
    """int4 in the words layout (formats.int4_to_words): a group's S words hold nibble j = k slice j; the 8
    dequantized slices are interleaved into one [BN, 8 S] tile, the activation gathered in the same order.
    DOTS (S >= 16): no interleave; per group 8 dots of a contiguous [BM, S] activation slice with nibble j's raw
    codes (exact in 16 bits), then sum(q a) * scale + sum(a) * min."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm                  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1] word rows
    offs_i = tl.arange(0, S)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, G):
        b = tl.load(w_rows + g * S + offs_i[None, :], mask=nm[:, None], other=0)                 # [BN, S]
        if DOTS:
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            asum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(8):
                kj = g * 8 * S + j * S + offs_i
                a = tl.load(x_rows + kj[None, :], mask=mm[:, None] & (kj < K)[None, :], other=0.0)    # [BM, S]
                part += _dot(a, tl.trans(((b >> (4 * j)) & 15).to(a.dtype)), IEEE)
                asum += tl.sum(a.to(tl.float32), axis=1)
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=nm, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=nm, other=0.0).to(tl.float32)
            acc += part * s[None, :] + asum[:, None] * z[None, :]
        else:
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=nm, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=nm, other=0.0).to(tl.float32)[:, None]
            kb = g * 8 * S + offs_i[None, :]                                                          # [1, S]
            ks = _join8(kb, kb + S, kb + 2 * S, kb + 3 * S, kb + 4 * S, kb + 5 * S, kb + 6 * S, kb + 7 * S)
            a = tl.load(x_rows + ks, mask=mm[:, None] & (ks < K), other=0.0)                        # [BM, 8 S]
            w = _join8(_dq(b, 0, s, z, a), _dq(b, 4, s, z, a), _dq(b, 8, s, z, a), _dq(b, 12, s, z, a),
                       _dq(b, 16, s, z, a), _dq(b, 20, s, z, a), _dq(b, 24, s, z, a), _dq(b, 28, s, z, a))
            acc += _dot(a, tl.trans(w), IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _gemm_w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, G, stride_xm, stride_wn, stride_sn,
                    stride_om, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm                  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1] packed rows
    offs_h = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, G):
        b = tl.load(w_rows + g * HALF + offs_h[None, :], mask=nm[:, None], other=0).to(tl.int32)   # [BN, 64]
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=nm, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + offs_n * stride_sn + g, mask=nm, other=0.0).to(tl.float32)[:, None]
        k_lo = g * 2 * HALF + offs_h
        a_lo = tl.load(x_rows + k_lo[None, :], mask=mm[:, None] & (k_lo < K)[None, :], other=0.0)  # [BM, 64]
        a_hi = tl.load(x_rows + HALF + k_lo[None, :], mask=mm[:, None] & (k_lo + HALF < K)[None, :], other=0.0)
        w_lo = ((b & 15).to(tl.float32) * s + z).to(a_lo.dtype)
        w_hi = ((b >> 4).to(tl.float32) * s + z).to(a_lo.dtype)
        acc += _dot(a_lo, tl.trans(w_lo), IEEE)
        acc += _dot(a_hi, tl.trans(w_hi), IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def quant_gemm_config(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the number of rows."""
    if M <= 16:
        return 16, 64, 4, 4
    if M <= 32:
        return 32, 64, 4, 4
    if M <= 64:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


def quant_matmul(x: torch.Tensor, fmt: str, qt: dict[str, torch.Tensor], shape: tuple[int, int],
                 bias: torch.Tensor | None = None,
                 config: tuple[int, int, int, int] | None = None, group_dots: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, N] = x @ W.T (+ bias), W the [N, K] weight the format's tensors qt stand for.
    group_dots (int4 words, groups of 128): 8 dots a group on raw codes.
    fp8 with quantized activations (w8a8) is kernels/quant_gemm_fp8.py's."""
    M, K = x.shape
    N = shape[0]
    assert K == shape[1] and x.stride(-1) == 1
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bn, warps, stages = config or quant_gemm_config(M)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    ieee = x.dtype == torch.float32
    if fmt == "int4":
        w, s, z = qt["qweight"], qt["scales"], qt["mins"]
        if w.dtype == torch.int32:                          # the words layout (formats.int4_to_words)
            _gemm_w4_words_kernel[grid](x, w, s, z, bias if bias is not None else w, out, M, N, K, s.shape[1],
                                        x.stride(0), w.stride(0), s.stride(0), out.stride(0),
                                        HAS_BIAS=bias is not None, IEEE=ieee, S=int4_group(qt) // 8, BLOCK_M=bm,
                                        BLOCK_N=bn, DOTS=group_dots and int4_group(qt) >= 128, num_warps=warps,
                                        num_stages=stages)
            return out
        _gemm_w4_kernel[grid](x, w, s, z, bias if bias is not None else w, out, M, N, K, s.shape[1],
                              x.stride(0), w.stride(0), s.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                              IEEE=ieee, HALF=int4_group(qt) // 2, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                              num_stages=stages)
    else:
        w = qt["weight"]
        s = qt["weight_scale"] if fmt == "int8" else qt["weight_scale_inv"]
        _gemm_w8_kernel[grid](x, w, s, bias if bias is not None else w, out, M, N, K, x.stride(0), w.stride(0),
                              s.stride(0), out.stride(0), FMT=FMT_IDS[fmt],
                              HAS_BIAS=bias is not None, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK,
                              num_warps=warps, num_stages=stages)
    return out


def quant_matmul_ref(x, fmt, qt, shape, bias=None, act_fp8=False):
    """Dequantize, then F.linear in fp32; act_fp8: activations first round-tripped through fp8 per 128-group."""
    w = dequantize(fmt, qt, shape)
    xf = quantize_activations_fp8_ref(x) if act_fp8 else x.float()
    y = torch.nn.functional.linear(xf, w, None if bias is None else bias.float())
    return y.to(x.dtype)
