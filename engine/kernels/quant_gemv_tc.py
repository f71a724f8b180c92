"""quant_gemv.py's small-batch fused linear on tensor cores: the M <= 16 activation rows are padded to one
16-row tile and each weight tile, decoded to 16-bit floats in registers, is multiplied with `tl.dot`
(fp32 accumulation). The CUDA-core kernels spend an fp32 conversion and an FMA per weight and row, and
conversions issue at 16 per clock per SM on Hopper, about the rate at which HBM delivers 1-byte weights;
here a weight costs its decode alone (fp8: half a conversion, int8 / int4 into fp16 or int4 into bf16: integer
operations), the multiplies go to the tensor cores.

Decodes into the dot's dtype DT (DOT bit 0 clear: the activation dtype; set: fp16, the activation rounded to
fp16 and saturated at +-65504), all exact:
- fp8 e4m3 -> DT by conversion (into fp16 one paired instruction per two weights; into bf16 via fp16);
- int8 -> DT: Triton's integer decode (no conversion instructions into fp16 / bf16);
- int4 -> bits: 0x6400 | q is the fp16 1024 + q, 0x4300 | q the bf16 128 + q; -> fp32 by conversion. DOT bit 1:
  the same bits four bytes at a time in inline PTX (about one integer instruction per weight instead of three).
A code offset OFF is undone on the rows' activation sums: sum(a (OFF + q)) - OFF sum(a).
Scales ride on the fp32 partial dots: int8's per-channel scale once at the end; fp8's block scale per 128-wide
k-block (a program's rows lie in one 128-row block, so it is one number); int4's scale and min per group:
s * sum(a q) + min * sum(a).
Prologues (rms_norm, silu_mul) and the epilogue are gemv.py's. At M = 1 the prologue runs on the one real row
and the tile is zero-padded afterwards (BLOCK_M 1), so the padding costs no prologue work.
Launch configs (BLOCK_N, BLOCK_K, num_warps, num_stages, DOT): QUANT_GEMV_TC_CONFIGS, from
benchmarks/sweep_quant_gemv.py.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.quant.formats import BLOCK, int4_group
from engine.kernels.gemv import PROLOGUES, _epilogue

DM: tl.constexpr = tl.constexpr(16)     # rows of the dot: tensor-core tiles are at least 16 rows
TC_FMT_IDS = {"int8": 0, "fp8": 1, "int4": 2}


@triton.jit
def _mma(a, w, IEEE: tl.constexpr):
    """a [DM, BK] @ w [BN, BK].T -> [DM, BN] fp32; fp32 operands in full fp32 (IEEE), not TF32."""
    if IEEE:
        out = tl.dot(a, tl.trans(w), input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(w))
    return out


@triton.jit
def _act(x_ptr, nw_ptr, offs_k, M, K, stride_xm, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
         DT: tl.constexpr):
    """prologue(x) at k offsets offs_k [BK] -> a [DM, BK] in DT (rows >= M zero); the squares of x (rms_norm:
    summed once after the loop, not every step) [BLOCK_M, BK] and the rows' sums of a as rounded to DT
    [BLOCK_M], fp32."""
    offs_m = tl.arange(0, BLOCK_M)
    km = offs_k < K
    xmask = (offs_m < M)[:, None] & km[None, :]
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm                  # [BM, 1]
    if PROLOGUE == 2:
        g = tl.load(x_rows + offs_k[None, :], mask=xmask, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + offs_k[None, :], mask=xmask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)            # rounded as the unfused kernel's
    else:
        a = tl.load(x_rows + offs_k[None, :], mask=xmask, other=0.0)
    sq = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if PROLOGUE == 1:
        af = a.to(tl.float32)
        sq = af * af
        a = af * tl.load(nw_ptr + offs_k, mask=km, other=0.0).to(tl.float32)[None, :]
    if DT == tl.float16 and x_ptr.dtype.element_ty != tl.float16:
        a = tl.minimum(tl.maximum(a.to(tl.float32), -65504.0), 65504.0)       # saturate, not inf, past fp16
    a = a.to(DT)
    sa = tl.sum(a.to(tl.float32), axis=1)
    if BLOCK_M == 1:            # [1, BK] -> [DM, BK]: the row, then zeros
        a = tl.where((tl.arange(0, DM) == 0)[:, None], a, tl.zeros([DM, 1], dtype=DT))
    return a, sq, sa


@triton.jit
def _w8_values(w, FMT: tl.constexpr, DT: tl.constexpr):
    """int8 bytes [BN, BK] (int8 codes or fp8 e4m3 bit patterns) -> DT values OFF + q (see the module doc)."""
    if FMT == 1:
        v = w.to(tl.float8e4nv, bitcast=True).to(DT)
    else:
        v = w.to(DT)
    return v


@triton.jit
def _nibble_values(q, DT: tl.constexpr):
    """int4 codes q (int32, 0..15) [BN, H] -> DT values OFF + q."""
    if DT == tl.float16:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)                # 1024 + q
    elif DT == tl.bfloat16:
        v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)               # 128 + q
    else:
        v = q.to(DT)
    return v


# int4 bytes -> (low, high nibbles) as 16-bit floats OFF + q: prmt spreads two bytes over two 16-bit halves,
# and + or set the exponent bits ({exp}: 0x6400 is fp16 1024, 0x4300 bf16 128)
_NIBBLE_ASM = """{{
            .reg .b32 t0, t1, u0, u1, z;
            mov.b32 z, 0;
            prmt.b32 t0, $4, z, 0x4140;
            prmt.b32 t1, $4, z, 0x4342;
            and.b32 u0, t0, 0x000F000F;
            and.b32 u1, t1, 0x000F000F;
            or.b32 $0, u0, {exp};
            or.b32 $1, u1, {exp};
            shr.b32 t0, t0, 4;
            shr.b32 t1, t1, 4;
            and.b32 u0, t0, 0x000F000F;
            and.b32 u1, t1, 0x000F000F;
            or.b32 $2, u0, {exp};
            or.b32 $3, u1, {exp};
            }}"""
_NIBBLES_FP16 = tl.constexpr(_NIBBLE_ASM.format(exp="0x64006400"))
_NIBBLES_BF16 = tl.constexpr(_NIBBLE_ASM.format(exp="0x43004300"))


@triton.jit
def _nibbles_packed(b, DT: tl.constexpr):
    """int4 bytes [BN, H] -> (low, high nibbles) as DT values OFF + q, four bytes per two integer instructions per
    output pair: inline PTX, compiled Triton only (not the interpreter)."""
    if DT == tl.float16:
        lo, hi = tl.inline_asm_elementwise(asm=_NIBBLES_FP16, constraints="=r,=r,=r,=r,r", args=[b],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(asm=_NIBBLES_BF16, constraints="=r,=r,=r,=r,r", args=[b],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _tc_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, s_row, M, K, G, stride_xm, stride_wn, stride_sn,
            FMT: tl.constexpr, PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr, IEEE: tl.constexpr,
            DT: tl.constexpr, OFF: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr = False):
    """-> ([DM, BN] fp32 prologue(x) @ W[offs_n].T, scales applied; [BLOCK_M] sums of squares (rms_norm)).
    FMT 0 int8, 1 fp8 (s_row: the block-scale row of the program's 128-row block), 2 int4 (groups of 2 HALF).
    OFF: int4's code offset in DT (code_offset); ASM: int4's packed inline-PTX decode. One loop step covers BLOCK_K weights along k: fp8 BLOCK_K / 128
    scale blocks, int4 BLOCK_K / (2 HALF) groups."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([DM, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1]
    if FMT == 2:
        GROUP: tl.constexpr = 2 * HALF
        offs_h = tl.arange(0, HALF)
        ss = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(BLOCK_K // GROUP):
                g = k0 // GROUP + j
                k_lo = g * GROUP + offs_h                                      # [H] the low nibbles' k's
                bp = w_rows + (g * HALF + offs_h)[None, :]                       # [BN, H] packed bytes
                bm = nm[:, None] & (k_lo < K)[None, :]
                a_lo, sq_lo, sa_lo = _act(x_ptr, nw_ptr, k_lo, M, K, stride_xm, PROLOGUE, BLOCK_M, DT)
                a_hi, sq_hi, sa_hi = _act(x_ptr, nw_ptr, k_lo + HALF, M, K, stride_xm, PROLOGUE, BLOCK_M, DT)
                if ASM:
                    q_lo, q_hi = _nibbles_packed(tl.load(bp, mask=bm, other=0), DT)
                else:
                    # the bytes loaded twice (the second from L2), once per nibble: a load with one use is what
                    # Triton pipelines through shared memory and decodes after the dot-operand load
                    q_lo = _nibble_values(tl.load(bp, mask=bm, other=0).to(tl.int32) & 15, DT)
                    q_hi = _nibble_values(tl.load(bp, mask=bm, other=0, eviction_policy="evict_first").to(tl.int32)
                                          >> 4, DT)
                part = _mma(a_lo, q_lo, IEEE) + _mma(a_hi, q_hi, IEEE)
                gm = nm & (g * GROUP + 0 * offs_n < K)                           # [BN]
                s = tl.load(s_ptr + offs_n * stride_sn + g, mask=gm, other=0.0).to(tl.float32)     # [BN]
                z = tl.load(z_ptr + offs_n * stride_sn + g, mask=gm, other=0.0).to(tl.float32)
                acc += part * s[None, :] + (sa_lo + sa_hi)[:, None] * (z - OFF * s)[None, :]
                ss += sq_lo + sq_hi
    else:
        SUB: tl.constexpr = BLOCK if FMT == 1 else BLOCK_K                     # fp8: one scale block per dot
        ss = tl.zeros([BLOCK_M, SUB], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(BLOCK_K // SUB):
                offs_k = k0 + j * SUB + tl.arange(0, SUB)
                w = tl.load(w_rows + offs_k[None, :], mask=nm[:, None] & (offs_k < K)[None, :], other=0)
                a, sq, _ = _act(x_ptr, nw_ptr, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_M, DT)
                part = _mma(a, _w8_values(w, FMT, DT), IEEE)                   # [DM, BN]
                if FMT == 1:
                    kb = (k0 + j * SUB) // BLOCK
                    acc += part * tl.load(s_row + kb, mask=kb * BLOCK < K, other=0.0)
                else:
                    acc += part
                ss += sq
        if FMT == 0:
            acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=nm, other=0.0)[None, :]
    return acc, tl.sum(ss, axis=1)


@triton.jit
def _gemv_tc_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K, G,
                    stride_xm, stride_wn, stride_sn, stride_rm, stride_om, eps,
                    FMT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                    USE_PDL: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr, OFF: tl.constexpr,
                    BLOCK: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, DM)
    mm, nm = offs_m < M, offs_n < N
    s_row = s_ptr + ((pid * BLOCK_N) // BLOCK).to(tl.int64) * stride_sn        # fp8: the rows' block of scales
    acc, ss = _tc_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, s_row, M, K, G, stride_xm, stride_wn,
                      stride_sn, FMT, PROLOGUE, USE_PDL, IEEE, DT, OFF, BLOCK, HALF, BLOCK_M, BLOCK_N, BLOCK_K, ASM)
    _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE, HAS_BIAS, HAS_RES)


# (format, N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, DOT) at M = 1 (DOT bit 0: fp16 operands, else the
# activation dtype's; bit 1: int4's packed inline-PTX decode). Guesses until benchmarks/sweep_quant_gemv.py --tc has run on an H200.
QUANT_GEMV_TC_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = {
    # H200, Llama-3.1-8B (--quick): the shapes where the tensor-core kernel beat the CUDA-core one by more than
    # 5% (int4 gate_up's 4% did not survive a whole decode step); with quant_gemv_tensor_cores=None the others
    # stay on CUDA cores (quant/linear.py: set_tensor_cores)
    ("int8", 6144, 4096): (32, 256, 2, 4, 0),       # 12.9 us vs 16.2
    ("fp8", 28672, 4096): (64, 256, 2, 4, 1),       # 34.9 us vs 49.1 (80% of the copy rate)
    ("int8", 28672, 4096): (32, 512, 2, 4, 0),      # 40.1 us vs 58.2
}


def quant_gemv_tc_config(fmt: str, M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, DOT): the swept entry for this shape, else a rule: 32 rows a
    program (128 programs for N = 4096), 256 weights of k a step, 4 stages of loads in flight; fp8 and int4 in
    fp16 (fp8 -> bf16 costs 1.5 conversions a weight on Hopper, -> fp16 0.5), int8 in bf16 (Triton's int8 -> bf16
    decode is integer operations, its int8 -> fp16 a conversion a weight)."""
    cfg = QUANT_GEMV_TC_CONFIGS.get((fmt, N, K))
    if cfg is None:
        cfg = (32, 256, 2, 4, 0 if fmt == "int8" else 1)
    return cfg


def tc_dtype(x_dtype: torch.dtype, dot: int) -> tl.dtype:
    """The dot's operand dtype: fp16 (DOT bit 0), else the activation dtype's."""
    if dot & 1:
        return tl.float16
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x_dtype]


def code_offset(fmt: str, dt: tl.dtype) -> float:
    """OFF of int4's decode into dt: the value of code q is OFF + q (bit decodes into 16-bit floats)."""
    if fmt == "int4":
        return {tl.float16: 1024.0, tl.bfloat16: 128.0}.get(dt, 0.0)
    return 0.0


def quant_fused_linear_tc(x: torch.Tensor, fmt: str, qt: dict[str, torch.Tensor], out: torch.Tensor, bias, prologue,
                          norm_weight, eps, residual, pdl: bool,
                          config: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    """quant_fused_linear's tensor-core kernel (checked arguments; out [M, N] allocated)."""
    M, N = out.shape
    K = x.shape[1] // 2 if prologue == "silu_mul" else x.shape[1]
    assert M <= 16, f"the tensor-core GEMV takes at most 16 rows (got {M})"
    bn, bk, warps, stages, dot = config or quant_gemv_tc_config(fmt, M, N, K)
    assert bn >= 16 and bk >= 16, f"tensor-core tiles are at least 16 wide (BLOCK_N {bn}, BLOCK_K {bk})"
    if fmt == "int4":
        w, s, z = qt["qweight"], qt["scales"], qt["mins"]
        group, G = int4_group(qt), qt["scales"].shape[1]
        bk = max(bk, group) if config is None else bk
        assert bk % group == 0, f"int4 BLOCK_K {bk} must be a multiple of the group size {group}"
    else:
        w = qt["weight"].view(torch.int8)                  # fp8: its bit patterns (decoded in the kernel)
        s = qt["weight_scale"] if fmt == "int8" else qt["weight_scale_inv"]
        z, group, G = s, 2, 0
        assert fmt == "int8" or (BLOCK % bn == 0 and bk % BLOCK == 0), \
            f"fp8 BLOCK_N {bn} must divide, BLOCK_K {bk} be a multiple of, the {BLOCK}-wide scale block"
    dt = tc_dtype(x.dtype, dot)
    asm = bool(dot & 2)
    assert not asm or (fmt == "int4" and dt in (tl.float16, tl.bfloat16) and not _interpreted()), \
        f"DOT {dot}: the packed (inline-PTX) decode is int4's into 16-bit floats, compiled only"
    _gemv_tc_kernel[(triton.cdiv(N, bn),)](
        x, w, s, z, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
        residual if residual is not None else out, out, M, N, K, G, x.stride(0), w.stride(0), s.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        FMT=TC_FMT_IDS[fmt], PROLOGUE=PROLOGUES[prologue], HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        USE_PDL=pdl, IEEE=dt == tl.float32, DT=dt, OFF=code_offset(fmt, dt), BLOCK=BLOCK, HALF=group // 2, BLOCK_M=1 if M == 1 else 16,
        BLOCK_N=bn, BLOCK_K=bk, ASM=asm, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}))
    return out


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
