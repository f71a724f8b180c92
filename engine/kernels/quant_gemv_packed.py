"""Packed-word decode GEMV (EngineConfig.quant_gemv_packed): quant_gemv.py's fused small-batch linear with the
weights read as int32 words and decoded with a few integer / packed-float instructions per word, and split-K.

Why: the CUDA-core GEMV spent ~8 instructions per weight per thread (README, "Quantized weights"), so int4 (half
of int8's bytes) ran as slowly as int8: issue-bound, not HBM-bound. Here:
- int4, words layout (formats.int4_to_words, repacked on load): word i of group g holds k = G g + j S + i in its
  nibble j (S = G / 8), so a [BN, NG, S] tile of words pairs with 8 contiguous [NG, S] activation slices. Per
  group the partial sum(q a) gets the scale and sum(a) the min (+ 8 scale when centred).
- int8 / fp8: [BN, BK / 4] words, four codes each; activation slices a_c at k = 4 i + c. The row scale (int8)
  once after the loop; fp8's block scale on the activation (a program's rows lie in one 128-row block).
- At M = 1 the [BN, columns] products accumulate elementwise and are reduced once after the loop (int4: per
  group, as its scale needs).
- SPLIT > 1: a grid of (row blocks, K chunks); each program atomically adds its fp32 partial (and its rows'
  sum of squares for the rms_norm prologue) into a workspace; the last program of a row block (an acq_rel
  counter) reads the sums back, zeroes the workspace and counter for the next call (CUDA-graph safe), and runs
  the epilogue. For the 4096-row projections, whose row blocks are few against 132 SMs.
The decodes (inline PTX, plain Triton for the interpreter) are quant_packed_decode.py's, the launch configs
quant_packed_configs.py's. Prologues (rms_norm, silu_mul), bias, residual epilogue and PDL are gemv.py's /
quant_gemv.py's. Config (BLOCK_N, BLOCK_K, num_warps, SPLIT, FLAGS): FLAGS bit 0 ASM, bit 1 PRE (the next tile's
load issued before this one's arithmetic). BLOCK_K counts weights (int4: a multiple of the group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.formats import BLOCK, int4_group
from engine.kernels.gemv import PROLOGUES, _epilogue, check_gemv_args
from engine.kernels.quant_gemv import _row_activation, _x_row
from engine.kernels.quant_packed_configs import _interpreted, packed_supported, quant_gemv_packed_config, rows_on_grid_default
from engine.kernels.quant_packed_decode import _W4_ASM, _bf16_pairs, _w8_codes

PK_FMT_IDS = {"int8": 0, "fp8": 1, "int4": 2}
WS_ROWS: tl.constexpr = tl.constexpr(16)        # workspace rows (M <= 16)


@triton.jit
def _pk_w8_load(w_rows, c0, nm, c_hi, NW: tl.constexpr):
    offs = c0 + tl.arange(0, NW)
    return tl.load(w_rows + offs[None, :], mask=nm[:, None] & (offs < c_hi)[None, :], other=0)   # [BN, NW]


@triton.jit
def _pk_w8_dot(x_ptr, w_ptr, s_ptr, nw_ptr, offs_n, nm, s_row, c_lo, c_hi, M, K, stride_xm, stride_wn, stride_sn,
               FMT: tl.constexpr, PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr,
               PRE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """-> ([BM, BN] prologue(x) @ W[offs_n].T over word columns [c_lo, c_hi) (int8: row scales applied), [BM] sums
    of squares of x there (rms_norm)). w_ptr: int32 words [N, K / 4]; s_row: fp8's block-scale row."""
    NW: tl.constexpr = BLOCK_K // 4
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1]
    w = _pk_w8_load(w_rows, c_lo, nm, c_hi, NW)                                # fetched before the PDL wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc2 = tl.zeros([BLOCK_N, NW], dtype=tl.float32)                          # M = 1: reduced after the loop
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, NW):
        if PRE:
            w_next = _pk_w8_load(w_rows, c0 + NW, nm, c_hi, NW)
        offs_c = c0 + tl.arange(0, NW)
        kk = tl.where(offs_c < c_hi, 4 * offs_c, K)                            # past the chunk: masked (k >= K)
        q0, q1, q2, q3 = _w8_codes(w, FMT, ASM)
        if FMT == 1:            # the block scales of the rows' 128-row block, per k: on the activation
            sc = tl.load(s_row + kk // BLOCK, mask=kk < K, other=0.0)
        for m in tl.static_range(BLOCK_M):
            x_row = _x_row(x_ptr, m, M, stride_xm, BLOCK_M)
            a0, s0 = _row_activation(x_row, nw_ptr, kk, K, PROLOGUE)
            a1, s1 = _row_activation(x_row, nw_ptr, kk + 1, K, PROLOGUE)
            a2, s2 = _row_activation(x_row, nw_ptr, kk + 2, K, PROLOGUE)
            a3, s3 = _row_activation(x_row, nw_ptr, kk + 3, K, PROLOGUE)
            if FMT == 1:
                a0, a1, a2, a3 = a0 * sc, a1 * sc, a2 * sc, a3 * sc
            if BLOCK_M == 1:    # fma chains into the elementwise accumulator
                acc2 += q0 * a0[None, :]
                acc2 += q1 * a1[None, :]
                acc2 += q2 * a2[None, :]
                acc2 += q3 * a3[None, :]
            else:
                p = q0 * a0[None, :]
                p += q1 * a1[None, :]
                p += q2 * a2[None, :]
                p += q3 * a3[None, :]
                acc = tl.where(offs_m[:, None] == m, acc + tl.sum(p, axis=1)[None, :], acc)
            if PROLOGUE == 1:
                ss = tl.where(offs_m == m, ss + (s0 + s1 + s2 + s3), ss)
        if PRE:
            w = w_next
        else:
            w = _pk_w8_load(w_rows, c0 + NW, nm, c_hi, NW)
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    if FMT == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=nm, other=0.0)[None, :]   # per-channel scale
    return acc, ss


@triton.jit
def _pk_w4_load(w_rows, g0, nm, g_hi, S: tl.constexpr, NG: tl.constexpr):
    """Groups [g0, g0 + NG) of BN word rows: [BN, NG, S] int32."""
    offs_g = g0 + tl.arange(0, NG)
    return tl.load(w_rows + (offs_g[:, None] * S + tl.arange(0, S)[None, :])[None, :, :],
                   mask=nm[:, None, None] & (offs_g < g_hi)[None, :, None], other=0)


@triton.jit
def _pk_w4_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, g_lo, g_hi, M, K, stride_xm, stride_wn, stride_sn,
               PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr,
               S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr):
    """-> ([BM, BN] prologue(x) @ W[offs_n].T over groups [g_lo, g_hi), [BM] sums of squares (rms_norm)): int4
    words [N, groups * S]; per group sum(q a) * scale + sum(a) * min."""
    GS: tl.constexpr = 8 * S                                                   # the group size
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_wn           # [BN, 1, 1]
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn                  # [BN, 1]
    z_rows = z_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    b = _pk_w4_load(w_rows, g_lo, nm, g_hi, S, NG)                             # fetched before the PDL wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc2 = tl.zeros([BLOCK_N, NG], dtype=tl.float32)                          # M = 1: reduced after the loop
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, NG):
        if PRE:
            b_next = _pk_w4_load(w_rows, g0 + NG, nm, g_hi, S, NG)
        offs_g = g0 + tl.arange(0, NG)
        gv = offs_g < g_hi
        gm = nm[:, None] & gv[None, :]
        s = tl.load(s_rows + offs_g[None, :], mask=gm, other=0.0).to(tl.float32)           # [BN, NG]
        z = tl.load(z_rows + offs_g[None, :], mask=gm, other=0.0).to(tl.float32)
        k0 = tl.where(gv, offs_g * GS, K)[:, None] + tl.arange(0, S)[None, :]             # [NG, S] nibble 0's k
        if not ASM:             # decoded once for all rows: 2^23 + q from bits, minus 2^23
            q0 = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            q1 = (((b >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            q2 = (((b >> 8) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            q3 = (((b >> 12) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            q4 = (((b >> 16) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            q5 = (((b >> 20) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            q6 = (((b >> 24) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            q7 = (((b >> 28) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        for m in tl.static_range(BLOCK_M):
            x_row = _x_row(x_ptr, m, M, stride_xm, BLOCK_M)
            a0, s0 = _row_activation(x_row, nw_ptr, k0, K, PROLOGUE)
            a1, s1 = _row_activation(x_row, nw_ptr, k0 + S, K, PROLOGUE)
            a2, s2 = _row_activation(x_row, nw_ptr, k0 + 2 * S, K, PROLOGUE)
            a3, s3 = _row_activation(x_row, nw_ptr, k0 + 3 * S, K, PROLOGUE)
            a4, s4 = _row_activation(x_row, nw_ptr, k0 + 4 * S, K, PROLOGUE)
            a5, s5 = _row_activation(x_row, nw_ptr, k0 + 5 * S, K, PROLOGUE)
            a6, s6 = _row_activation(x_row, nw_ptr, k0 + 6 * S, K, PROLOGUE)
            a7, s7 = _row_activation(x_row, nw_ptr, k0 + 7 * S, K, PROLOGUE)
            if ASM:             # the products use the bf16-rounded activations, sum(a) the fp32 ones
                p = tl.inline_asm_elementwise(
                    _W4_ASM, "=f,r,r,r,r,r",
                    [b, _bf16_pairs(a0, a4)[None, :, :], _bf16_pairs(a1, a5)[None, :, :],
                     _bf16_pairs(a2, a6)[None, :, :], _bf16_pairs(a3, a7)[None, :, :]],
                    dtype=tl.float32, is_pure=True, pack=1)                    # [BN, NG, S]: sum (q - 8) a
            else:               # a chain of fmas
                p = q0 * a0[None, :, :]
                p += q1 * a1[None, :, :]
                p += q2 * a2[None, :, :]
                p += q3 * a3[None, :, :]
                p += q4 * a4[None, :, :]
                p += q5 * a5[None, :, :]
                p += q6 * a6[None, :, :]
                p += q7 * a7[None, :, :]
            sa = tl.sum(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7, axis=1)                      # [NG]
            if ASM:             # centred codes: w = (q - 8) s + (min + 8 s)
                part = tl.sum(p, axis=2) * s + sa[None, :] * (z + 8.0 * s)                  # [BN, NG]
            else:
                part = tl.sum(p, axis=2) * s + sa[None, :] * z
            if BLOCK_M == 1:
                acc2 += part
            else:
                acc = tl.where(offs_m[:, None] == m, acc + tl.sum(part, axis=1)[None, :], acc)
            if PROLOGUE == 1:
                ss = tl.where(offs_m == m, ss + (s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7), ss)
        if PRE:
            b = b_next
        else:
            b = _pk_w4_load(w_rows, g0 + NG, nm, g_hi, S, NG)
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    return acc, ss


@triton.jit
def _pk_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, C, per,
                    stride_xm, stride_wn, stride_sn, stride_rm, stride_om, eps,
                    FMT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                    USE_PDL: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, ROWS: tl.constexpr = False):
    """C: the weight's columns in split units (int4: groups; else words), per: a K chunk's units (SPLIT > 1).
    ROWS: the activation rows on grid axis 0 (launched with M = 1, BLOCK_M = 1): each program runs the M = 1 dot
    for its row r (x, residual and out offset by r; workspace row r, counter r of its row block); the programs of
    one weight tile are neighbours in launch order, so the rows after the first read it from L2."""
    if ROWS:
        row = tl.program_id(0)
        pid = tl.program_id(1)
        kid = tl.program_id(2)
        x_ptr += row.to(tl.int64) * stride_xm
        r_ptr += row.to(tl.int64) * stride_rm
        out_ptr += row.to(tl.int64) * stride_om
    else:
        row = 0
        pid = tl.program_id(0)
        kid = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    if SPLIT == 1:
        c_lo, c_hi = 0, C
    else:
        c_lo = kid * per
        c_hi = tl.minimum(c_lo + per, C)
    if FMT == 2:
        acc, ss = _pk_w4_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, c_lo, c_hi, M, K, stride_xm, stride_wn,
                             stride_sn, PROLOGUE, USE_PDL, ASM, PRE, S, BLOCK_M, BLOCK_N, BLOCK_K // (8 * S))
    else:
        s_row = s_ptr + ((pid * BLOCK_N) // BLOCK).to(tl.int64) * stride_sn    # fp8: the rows' block of scales
        acc, ss = _pk_w8_dot(x_ptr, w_ptr, s_ptr, nw_ptr, offs_n, nm, s_row, c_lo, c_hi, M, K, stride_xm, stride_wn,
                             stride_sn, FMT, PROLOGUE, USE_PDL, ASM, PRE, BLOCK, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT == 1:
        _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
                  PROLOGUE, HAS_BIAS, HAS_RES)
    else:
        omask = mm[:, None] & nm[None, :]
        wp = ws_ptr + (row + offs_m)[:, None] * N + offs_n[None, :]            # [WS_ROWS, N] partial sums
        sp = ws_ptr + WS_ROWS * N + pid * WS_ROWS + row + offs_m               # then [row blocks, WS_ROWS] squares
        cp = cnt_ptr + pid * WS_ROWS + row                                     # [row blocks, WS_ROWS] counters
        tl.atomic_add(wp, acc, mask=omask, sem="relaxed")
        if PROLOGUE == 1:
            tl.atomic_add(sp, ss, mask=mm, sem="relaxed")
        tl.debug_barrier()      # every warp's partials issued before the release (not left to a scratch barrier)
        done = tl.atomic_add(cp, 1, sem="acq_rel")
        if done == SPLIT - 1:   # the row block's last program: every other partial is in
            tot = tl.load(wp, mask=omask, other=0.0, cache_modifier=".cg")
            ss_t = ss
            if PROLOGUE == 1:
                ss_t = tl.load(sp, mask=mm, other=0.0, cache_modifier=".cg")
            # every thread holds its copies before any thread zeroes them: the squares ss_t [BM] (and at M = 1 the
            # [1, BN] sums on several warps) are replicated across threads, the zeroing store is one owner's, so
            # without the barrier a warp could read a square already zeroed (1 / rms of 1 / sqrt(eps): seen on
            # the H200 as a second call off by 69x, fp8 M = 4 rms_norm split 2 on two warps)
            tl.debug_barrier()
            tl.store(wp, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), mask=omask)
            if PROLOGUE == 1:
                tl.store(sp, tl.zeros([BLOCK_M], dtype=tl.float32), mask=mm)
            tl.store(cp, 0)
            _epilogue(tot, ss_t, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
                      PROLOGUE, HAS_BIAS, HAS_RES)



_WS: dict = {}


def _workspace(device, N: int, bn: int):
    """Per (device, N, BLOCK_N): fp32 [16 N + 16 row blocks] partial sums and squares, int32 [16 row blocks]
    counters (one a row for the ROWS grid); zero, and left zero by every split-K launch."""
    key = (device, N, bn)
    if key not in _WS:
        nb = triton.cdiv(N, bn)
        _WS[key] = (torch.zeros(16 * N + 16 * nb, dtype=torch.float32, device=device),
                    torch.zeros(16 * nb, dtype=torch.int32, device=device))
    return _WS[key]


def pk_tensors(fmt: str, qt: dict[str, torch.Tensor]):
    """(words, scales, mins-or-scales, group) as the kernel takes them."""
    if fmt == "int4":
        w = qt["qweight"]
        assert w.dtype == torch.int32, "the packed GEMV takes int4 in the words layout (formats.int4_to_words)"
        return w, qt["scales"], qt["mins"], int4_group(qt)
    w = qt["weight"].view(torch.int8).view(torch.int32)       # [N, K / 4] words
    s = qt["weight_scale"] if fmt == "int8" else qt["weight_scale_inv"]
    return w, s, s, 0


def quant_fused_linear_packed(x: torch.Tensor, fmt: str, qt: dict[str, torch.Tensor], shape: tuple[int, int],
                              bias: torch.Tensor | None = None, *, prologue: str | None = None,
                              norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                              residual: torch.Tensor | None = None, pdl: bool = False,
                              config: tuple[int, int, int, int, int] | None = None,
                              rows_on_grid: bool | None = None) -> torch.Tensor:
    """quant_fused_linear's contract (kernels/quant_gemv.py) on this file's kernel: x [M <= 16, K] (or [M, 2K] for
    silu_mul) -> [M, N]. config: (BLOCK_N, BLOCK_K, num_warps, SPLIT, FLAGS), else quant_gemv_packed_config.
    rows_on_grid (M > 1): each row its own programs running the M = 1 dot (the kernel's ROWS); None: rows_on_grid's
    default for the format (int4 on, int8 / fp8 off: their M rows share a program)."""
    M = x.shape[0]
    N, K = shape
    check_gemv_args(x, N, K, prologue, norm_weight, residual)
    assert M <= 16, f"the packed GEMV takes at most 16 rows (got {M})"
    assert packed_supported(fmt, K), (fmt, K)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bn, bk, warps, split, flags = config or quant_gemv_packed_config(fmt, M, N, K)
    asm, pre = bool(flags & 1), bool(flags & 2)
    assert not asm or not _interpreted(), "the packed (inline-PTX) decode runs compiled only"
    asm = asm and (fmt != "int4" or x.dtype == torch.bfloat16)    # int4's bf16x2 products: bf16 activations only
    w, s, z, group = pk_tensors(fmt, qt)
    if fmt == "int4":
        assert bk % group == 0, f"int4 BLOCK_K {bk} must be a multiple of the group size {group}"
        units, tile, S = s.shape[1], bk // group, group // 8
    else:
        assert fmt == "int8" or BLOCK % bn == 0, f"fp8 BLOCK_N {bn} must divide the {BLOCK}-row scale block"
        units, tile, S = K // 4, bk // 4, 1
    split = max(1, min(split, triton.cdiv(units, tile)))
    per = triton.cdiv(triton.cdiv(units, split), tile) * tile
    split = triton.cdiv(units, per)
    nb = triton.cdiv(N, bn)
    rows = M > 1 and (rows_on_grid if rows_on_grid is not None else rows_on_grid_default(fmt))
    ws, cnt = _workspace(x.device, N, bn) if split > 1 else (out, out)
    _pk_gemv_kernel[(M, nb, split) if rows else (nb, split)](
        x, w, s, z, bias if bias is not None else w, norm_weight if norm_weight is not None else w,
        residual if residual is not None else out, out, ws, cnt, 1 if rows else M, N, K, units, per,
        x.stride(0), w.stride(0), s.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        FMT=PK_FMT_IDS[fmt], PROLOGUE=PROLOGUES[prologue], HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        USE_PDL=pdl, ASM=asm, PRE=pre, SPLIT=split, BLOCK=BLOCK, S=S,
        BLOCK_M=1 if rows else max(1, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk, ROWS=rows,
        num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return out

