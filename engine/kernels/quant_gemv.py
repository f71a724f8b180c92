"""fused_linear (see gemv.py) over quantized weights: the small-batch decode linear reading 1 or 1/2 byte per
weight instead of 2, with the same RMSNorm / SiLU-mul prologues and residual epilogue.

Formats (engine/quant/formats.py), weight-only (activations stay in the model dtype, fp32 accumulation):
- int8 per-channel: codes times activations, the row scale once after the dot;
- fp8 block-wise: a program's rows lie in one 128-row block (BLOCK_N divides 128), so the block scales of a
  k-tile are a vector over k that multiplies the activation, not every weight;
- int4 group-wise: a tile is [rows, groups, bytes]; per group sum(q * a) * scale + sum(a) * min.
A weight tile is decoded to fp32 once, then multiplied by each activation row in turn. CVT picks the decode: 0
the conversion instructions; 1 the bits of 2^23 + q (an integer add and a float subtract); 2 (int8) the bits of
1 + (q + 128) / 256 (one integer multiply-add), the offset undone on the row sums. int->float conversions issue
at 16 per clock per SM on Hopper, while 1/2-1 byte weights at full bandwidth need 16-32; which decode wins
depends on the kernel around it (H200: the first version's int8 conversions 1.6x slower than CVT 1; in this one
int8 / int4 within 5% either way, fp8's bit decode 1.1-1.4x slower than Hopper's paired e4m3 conversion), so
CVT is part of the swept config.
Launch configs come from QUANT_GEMV_CONFIGS (benchmarks/sweep_quant_gemv.py's winners per format and shape).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.formats import BLOCK, dequantize, int4_group
from engine.kernels import torch_ops
from engine.kernels.gemv import PROLOGUES, _epilogue, check_gemv_args
from engine.kernels.quant_gemv_tc import quant_fused_linear_tc

FMT_IDS = {"int8": 0, "fp8": 1}


@triton.jit
def _w8_values(w, FMT: tl.constexpr, CVT: tl.constexpr):
    """Weight bytes as int8 (int8 codes, or fp8 e4m3 bit patterns) -> fp32 code values (scales not applied)."""
    if CVT == 0:
        if FMT == 0:
            return w.to(tl.float32)
        return w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    x = w.to(tl.int32)                                                         # sign-extended
    if FMT == 0:
        if CVT == 2:            # 1 + (q + 128) / 256 in one integer multiply-add (see _w8_rows)
            return (x * 32768 + 0x3FC00000).to(tl.float32, bitcast=True)
        return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0    # bits of 1.5 * 2^23 + q
    # seeeemmm -> sign to bit 31, eeeemmm to bits 26..20: the fp32 with those bits is the fp8 value * 2^-120
    # (subnormal codes give fp32 denormals; plain fp32 multiplies keep them)
    return ((x << 20) & -2014314496).to(tl.float32, bitcast=True) * 1.329227995784916e36   # mask 0x87F00000


@triton.jit
def _row_activation(x_row, nw_ptr, offs_k, K, PROLOGUE: tl.constexpr):
    """prologue(x) of one row at k offsets offs_k (any shape) in fp32, and its sum of squares (rms_norm; else
    0)."""
    km = offs_k < K
    if PROLOGUE == 2:
        g = tl.load(x_row + offs_k, mask=km, other=0.0).to(tl.float32)
        u = tl.load(x_row + K + offs_k, mask=km, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(x_row.dtype.element_ty).to(tl.float32)
    else:
        a = tl.load(x_row + offs_k, mask=km, other=0.0).to(tl.float32)
    sq = 0.0
    if PROLOGUE == 1:
        sq = tl.sum(a * a)
        a = a * tl.load(nw_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
    return a, sq


@triton.jit
def _x_row(x_ptr, m: tl.constexpr, M, stride_xm, BLOCK_M: tl.constexpr):
    """Row m of the activation; rows past M (padding to BLOCK_M) read row M - 1, their outputs are not stored."""
    if BLOCK_M == 1:
        return x_ptr
    return x_ptr + tl.minimum(M - 1, m) * stride_xm


@triton.jit
def _acc_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulators: per row m the dot [BN] and the sum of squares. At M = 1 a [BN] vector that keeps the layout
    the k-reduction leaves it in (a [1, BN] tile would be re-laid out through shared memory every k-tile)."""
    if BLOCK_M == 1:            # one return: Triton checks every return of a function for one type
        acc, ss = tl.zeros([BLOCK_N], dtype=tl.float32), tl.zeros([1], dtype=tl.float32)
    else:
        acc, ss = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)
    return acc, ss


@triton.jit
def _add_row(acc, ss, part, sq, offs_m, m, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc[m] += part [BN]; ss[m] += sq (rms_norm)."""
    if BLOCK_M == 1:
        acc += part
        if PROLOGUE == 1:
            ss += sq
    else:
        acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
        if PROLOGUE == 1:
            ss = tl.where(offs_m == m, ss + sq, ss)
    return acc, ss


@triton.jit
def _acc_rows(acc, BLOCK_M: tl.constexpr):
    """-> [BM, BN] for the epilogue."""
    if BLOCK_M == 1:
        out = acc[None, :]
    else:
        out = acc
    return out


@triton.jit
def _w8_load(w_rows, offs_k, nm, K):
    return tl.load(w_rows + offs_k[None, :], mask=nm[:, None] & (offs_k < K)[None, :], other=0)   # [BN, BK]


@triton.jit
def _w8_rows(w, acc, ss, x_ptr, nw_ptr, s_row, offs_k, offs_m, M, K, stride_xm, FMT: tl.constexpr,
             PROLOGUE: tl.constexpr, CVT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """One k-tile w [BN, BK] of raw bytes against each of the M activation rows: the weights are decoded once."""
    wf = _w8_values(w, FMT, CVT)                                               # [BN, BK] fp32
    if FMT == 1:                # block scales of the program's 128-row block, per k: they ride on the activation
        sc = tl.load(s_row + offs_k // BLOCK, mask=offs_k < K, other=0.0)
    for m in tl.static_range(BLOCK_M):
        a, sq = _row_activation(_x_row(x_ptr, m, M, stride_xm, BLOCK_M), nw_ptr, offs_k, K, PROLOGUE)    # [BK]
        if FMT == 1:
            a = a * sc
        part = tl.sum(a[None, :] * wf, axis=1)                                  # [BN]
        if CVT == 2:    # wf = 1 + (q + 128) / 256, a * wf exact: sum(a q) = 256 sum(a wf) - 384 sum(a). Both sums
            part = part * 256.0 - 384.0 * tl.sum(a)     # are O(sum |a|): the difference keeps ~15 bits; bf16 has 8
        acc, ss = _add_row(acc, ss, part, sq, offs_m, m, PROLOGUE, BLOCK_M)
    return acc, ss


@triton.jit
def _w8_dot(x_ptr, w_ptr, s_ptr, nw_ptr, offs_n, nm, s_row, M, K, stride_xm, stride_wn, stride_sn,
            FMT: tl.constexpr, PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr, CVT: tl.constexpr, PRE: tl.constexpr,
            BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """-> ([BM, BN] prologue(x) @ W[offs_n].T (int8: row scales applied), [BM] sums of squares (rms_norm)).
    s_row: fp8's row of block scales for rows offs_n (one 128-row block)."""
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1]
    offs_k = tl.arange(0, BLOCK_K)
    w = _w8_load(w_rows, offs_k, nm, K)                                        # fetched before the PDL wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc, ss = _acc_init(BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if PRE:                 # the next tile is in flight while this one is multiplied
            w_next = _w8_load(w_rows, offs_k + BLOCK_K, nm, K)
        acc, ss = _w8_rows(w, acc, ss, x_ptr, nw_ptr, s_row, offs_k, offs_m, M, K, stride_xm, FMT, PROLOGUE, CVT,
                           BLOCK, BLOCK_M)
        if PRE:
            w = w_next
        else:
            w = _w8_load(w_rows, offs_k + BLOCK_K, nm, K)
    acc = _acc_rows(acc, BLOCK_M)
    if FMT == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=nm, other=0.0)[None, :]   # per-channel scale
    return acc, ss


@triton.jit
def _gemv_w8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_rm, stride_om, eps,
                    FMT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                    USE_PDL: tl.constexpr, CVT: tl.constexpr, PRE: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    s_row = s_ptr + ((pid * BLOCK_N) // BLOCK).to(tl.int64) * stride_sn        # fp8: the rows' block of scales
    acc, ss = _w8_dot(x_ptr, w_ptr, s_ptr, nw_ptr, offs_n, nm, s_row, M, K, stride_xm, stride_wn, stride_sn,
                      FMT, PROLOGUE, USE_PDL, CVT, PRE, BLOCK, BLOCK_M, BLOCK_N, BLOCK_K)
    _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE, HAS_BIAS, HAS_RES)


@triton.jit
def _w4_load(w_rows, g0, nm, G, HALF: tl.constexpr, NG: tl.constexpr):
    """Groups [g0, g0 + NG) of BN packed rows: [BN, NG, H] bytes."""
    offs_g = g0 + tl.arange(0, NG)
    offs_h = tl.arange(0, HALF)
    return tl.load(w_rows + (offs_g[:, None] * HALF + offs_h[None, :])[None, :, :],
                   mask=nm[:, None, None] & (offs_g < G)[None, :, None], other=0)


@triton.jit
def _w4_rows(b, acc, ss, x_ptr, nw_ptr, s_rows, z_rows, g0, nm, offs_m, M, K, G, stride_xm,
             PROLOGUE: tl.constexpr, CVT: tl.constexpr, HALF: tl.constexpr, NG: tl.constexpr,
             BLOCK_M: tl.constexpr):
    """Bytes b [BN, NG, H] of groups [g0, g0 + NG) against each activation row. A group's scale and min multiply
    its partial sums sum(q * a) and sum(a) once, not every weight."""
    offs_g = g0 + tl.arange(0, NG)
    gm = nm[:, None] & (offs_g < G)[None, :]
    s = tl.load(s_rows + offs_g[None, :], mask=gm, other=0.0).to(tl.float32)           # [BN, NG]
    z = tl.load(z_rows + offs_g[None, :], mask=gm, other=0.0).to(tl.float32)
    k2 = offs_g[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]                     # [NG, H] low k's
    bi = b.to(tl.int32)
    if CVT == 0:
        q_lo = (bi & 15).to(tl.float32)
        q_hi = (bi >> 4).to(tl.float32)
    else:
        q_lo = ((bi & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0        # bits of 2^23 + q
        q_hi = ((bi & 240) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0       # 16 * the high code
    for m in tl.static_range(BLOCK_M):
        x_row = _x_row(x_ptr, m, M, stride_xm, BLOCK_M)
        a_lo, sq_lo = _row_activation(x_row, nw_ptr, k2, K, PROLOGUE)              # [NG, H]
        a_hi, sq_hi = _row_activation(x_row, nw_ptr, k2 + HALF, K, PROLOGUE)
        sa = tl.sum(a_lo + a_hi, axis=1)                                                # [NG]
        if CVT == 1:
            a_hi = a_hi * 0.0625
        qa = tl.sum(a_lo[None, :, :] * q_lo + a_hi[None, :, :] * q_hi, axis=2)         # [BN, NG]
        part = tl.sum(qa * s + sa[None, :] * z, axis=1)                                 # [BN]
        acc, ss = _add_row(acc, ss, part, sq_lo + sq_hi, offs_m, m, PROLOGUE, BLOCK_M)
    return acc, ss


@triton.jit
def _w4_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, M, K, G, stride_xm, stride_wn, stride_sn,
            PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr, CVT: tl.constexpr, PRE: tl.constexpr,
            HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr):
    """-> ([BM, BN] prologue(x) @ W[offs_n].T, [BM] sums of squares (rms_norm)) over int4 packed rows."""
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn            # [BN, 1, 1] packed rows
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn                  # [BN, 1]
    z_rows = z_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    b = _w4_load(w_rows, 0, nm, G, HALF, NG)                                   # fetched before the PDL wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc, ss = _acc_init(BLOCK_M, BLOCK_N)
    for g0 in range(0, G, NG):
        if PRE:
            b_next = _w4_load(w_rows, g0 + NG, nm, G, HALF, NG)
        acc, ss = _w4_rows(b, acc, ss, x_ptr, nw_ptr, s_rows, z_rows, g0, nm, offs_m, M, K, G, stride_xm,
                           PROLOGUE, CVT, HALF, NG, BLOCK_M)
        if PRE:
            b = b_next
        else:
            b = _w4_load(w_rows, g0 + NG, nm, G, HALF, NG)
    return _acc_rows(acc, BLOCK_M), ss


@triton.jit
def _gemv_w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K, G,
                    stride_xm, stride_wn, stride_sn, stride_rm, stride_om, eps,
                    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
                    CVT: tl.constexpr, PRE: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, NG: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    acc, ss = _w4_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, M, K, G, stride_xm, stride_wn, stride_sn,
                      PROLOGUE, USE_PDL, CVT, PRE, HALF, BLOCK_M, BLOCK_N, NG)
    _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE, HAS_BIAS, HAS_RES)


# (format, N, K) -> (BLOCK_N, BLOCK_K, num_warps, CVT, PRE) at M = 1: benchmarks/sweep_quant_gemv.py's best on an
# H200 (BLOCK_K counts weights, two per int4 byte; PRE 1: the next k-tile is loaded before this one is multiplied)
QUANT_GEMV_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = {
    # Llama-3.1-8B: qkv, o, gate_up, down (--quick grid; int4 and int8 o: CVT 0 timed at the best CVT 1 config)
    ("fp8", 6144, 4096): (4, 1024, 1, 0, 0),
    ("int8", 6144, 4096): (4, 1024, 4, 1, 1),
    ("int4", 6144, 4096): (4, 1024, 1, 0, 0),
    ("fp8", 4096, 4096): (8, 1024, 4, 0, 1),
    ("int8", 4096, 4096): (4, 1024, 2, 1, 1),
    ("int4", 4096, 4096): (4, 1024, 2, 0, 1),
    ("fp8", 28672, 4096): (4, 1024, 1, 0, 0),
    ("int8", 28672, 4096): (4, 1024, 4, 1, 1),
    ("int4", 28672, 4096): (4, 1024, 1, 1, 0),
    ("fp8", 4096, 14336): (8, 1024, 4, 0, 1),
    ("int8", 4096, 14336): (16, 1024, 4, 1, 1),
    ("int4", 4096, 14336): (8, 2048, 4, 0, 1),
}


def quant_gemv_config(fmt: str, M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, CVT, PRE) for an [M <= 16, K] x [N, K].T product: the swept entry for this
    shape, else the 8B winners' pattern by the projection's aspect (down: K > N; o: square; else qkv / gate_up).
    The decode (CVT) is the one that won most often for the format.
    BLOCK_K shrinks as M grows (each row's activation tile is live beside the weights)."""
    cfg = QUANT_GEMV_CONFIGS.get((fmt, N, K))
    if cfg is None:
        cvt = 1 if fmt == "int8" else 0
        if K > N:
            cfg = (8, 2048, 4, cvt, 1) if fmt == "int4" else (16, 1024, 4, cvt, 1)
        elif N == K:
            cfg = (8, 1024, 4, cvt, 1)
        else:
            cfg = (4, 1024, 1, cvt, 1)
    bn, bk, warps, cvt, pre = cfg
    bm = triton.next_power_of_2(M)
    return bn, max(64, min(bk // max(1, bm // 2), triton.next_power_of_2(K))), warps, cvt, pre


def quant_fused_linear(x: torch.Tensor, fmt: str, qt: dict[str, torch.Tensor], shape: tuple[int, int],
                       bias: torch.Tensor | None = None, *, prologue: str | None = None,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       residual: torch.Tensor | None = None, pdl: bool = False, tensor_cores: bool = False,
                       config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] for silu_mul) -> [M, N] = prologue(x) @ W.T (+ bias) (+ residual), W the [N, K]
    weight the format's tensors qt stand for (engine/quant/formats.py). M is small (a decode step).
    tensor_cores: quant_gemv_tc.py's kernel (M <= 16; config (BLOCK_N, BLOCK_K, num_warps, num_stages, DOT)),
    else this file's (config (BLOCK_N, BLOCK_K, num_warps, CVT, PRE)); None: each one's table or rule."""
    M = x.shape[0]
    N, K = shape
    check_gemv_args(x, N, K, prologue, norm_weight, residual)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if tensor_cores:
        return quant_fused_linear_tc(x, fmt, qt, out, bias, prologue, norm_weight, eps, residual, pdl, config)
    bn, bk, warps, cvt, pre = config or quant_gemv_config(fmt, M, N, K)
    dummy = qt.get("weight", qt.get("qweight"))
    common = dict(PROLOGUE=PROLOGUES[prologue], HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                  USE_PDL=pdl, CVT=cvt, PRE=pre, BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=bn,
                  num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    args_tail = (bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
                 residual if residual is not None else out, out)
    rs = residual.stride(0) if residual is not None else 0
    if fmt == "int4":
        w, s, z = qt["qweight"], qt["scales"], qt["mins"]
        group = int4_group(qt)
        bk = bk if config else max(bk, group)
        assert bk % group == 0, f"int4 BLOCK_K {bk} must be a multiple of the group size {group}"
        _gemv_w4_kernel[(triton.cdiv(N, bn),)](
            x, w, s, z, *args_tail, M, N, K, s.shape[1], x.stride(0), w.stride(0), s.stride(0), rs,
            out.stride(0), eps, HALF=group // 2, NG=bk // group, **common)
    else:
        w = qt["weight"].view(torch.int8)                  # fp8: its bit patterns (decoded in the kernel)
        s = qt["weight_scale"] if fmt == "int8" else qt["weight_scale_inv"]
        assert fmt == "int8" or BLOCK % bn == 0, f"fp8 BLOCK_N {bn} must divide the {BLOCK}-row scale block"
        assert cvt < 2 or fmt == "int8", f"CVT {cvt} is int8's"
        _gemv_w8_kernel[(triton.cdiv(N, bn),)](
            x, w, s, *args_tail, M, N, K, x.stride(0), w.stride(0), s.stride(0), rs, out.stride(0), eps,
            FMT=FMT_IDS[fmt], BLOCK=BLOCK, BLOCK_K=bk, **common)
    return out


def quant_fused_linear_ref(x, fmt, qt, shape, bias=None, *, prologue=None, norm_weight=None, eps=1e-6,
                           residual=None, pdl=False, tensor_cores=False):
    """Dequantize, then the unfused torch composition."""
    w = dequantize(fmt, qt, shape, x.dtype)
    return torch_ops.fused_linear(x, w, bias, prologue=prologue, norm_weight=norm_weight, eps=eps,
                                  residual=residual)
