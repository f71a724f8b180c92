"""The packed-word GEMV's inline-PTX decodes (kernels/quant_gemv_packed.py), with plain-Triton equivalents for the
interpreter and as the ablation. Each block takes int32 words of codes and either returns the
codes as fp32 or the word's dot with its activations:
- int4 words (formats.int4_to_words): nibbles j, j + 4 -> a bf16 pair, centred, four bf16x2 fmas a word;
- int8 / fp8: four fp32 codes a word (a prmt into 2^23 + q + 128; fp8 by paired e4m3 -> f16x2 conversions);
"""
from __future__ import annotations

import triton
import triton.language as tl

# int4 word -> sum over its 8 nibbles of (q_j - 8) a_j. $1 the word, $2..$5 bf16 pairs (a_p, a_p+4);
# (w >> 4p) & 0x000F000F | 0x43004300 holds nibbles p, p + 4 as the bf16 pair 128 + q; minus 136 is q - 8 exactly
# (centred codes: the partial sums stay small, so their bf16 rounding is small beside the result); the products
# accumulate in bf16x2 fmas, the two halves are added in fp32.
_W4_ASM = tl.constexpr("""{
    .reg .b32 w, t, q, acc, one, msk, ex, off, z;
    .reg .f32 lo, hi;
    mov.b32 one, 0x3F803F80;
    mov.b32 msk, 0x000F000F;
    mov.b32 ex, 0x43004300;
    mov.b32 off, 0xC308C308;
    mov.b32 z, 0x80008000;
    lop3.b32 t, $1, msk, ex, 0xEA;
    fma.rn.bf16x2 q, t, one, off;
    fma.rn.bf16x2 acc, q, $2, z;
    shr.u32 w, $1, 4;
    lop3.b32 t, w, msk, ex, 0xEA;
    fma.rn.bf16x2 q, t, one, off;
    fma.rn.bf16x2 acc, q, $3, acc;
    shr.u32 w, $1, 8;
    lop3.b32 t, w, msk, ex, 0xEA;
    fma.rn.bf16x2 q, t, one, off;
    fma.rn.bf16x2 acc, q, $4, acc;
    shr.u32 w, $1, 12;
    lop3.b32 t, w, msk, ex, 0xEA;
    fma.rn.bf16x2 q, t, one, off;
    fma.rn.bf16x2 acc, q, $5, acc;
    shl.b32 t, acc, 16;
    and.b32 w, acc, 0xFFFF0000;
    mov.b32 lo, t;
    mov.b32 hi, w;
    add.f32 $0, lo, hi;
}""")

# int8 word (4 codes, k order) -> 4 fp32 codes: u = w ^ 0x80808080 (q + 128 per byte), prmt puts byte c into
# 0x4B0000uu (2^23 + u), minus 2^23 + 128
_W8_ASM = tl.constexpr("""{
    .reg .b32 u, c, t0, t1, t2, t3;
    .reg .f32 f0, f1, f2, f3;
    xor.b32 u, $4, 0x80808080;
    mov.b32 c, 0x4B000000;
    prmt.b32 t0, u, c, 0x7650;
    prmt.b32 t1, u, c, 0x7651;
    prmt.b32 t2, u, c, 0x7652;
    prmt.b32 t3, u, c, 0x7653;
    mov.b32 f0, t0;
    mov.b32 f1, t1;
    mov.b32 f2, t2;
    mov.b32 f3, t3;
    sub.f32 $0, f0, 0f4B000080;
    sub.f32 $1, f1, 0f4B000080;
    sub.f32 $2, f2, 0f4B000080;
    sub.f32 $3, f3, 0f4B000080;
}""")

# fp8 e4m3 word (4 codes) -> 4 fp32 values: two paired conversions into f16x2, then widening
_F8_ASM = tl.constexpr("""{
    .reg .b16 b0, b1, h0, h1, h2, h3;
    .reg .b32 x01, x23;
    mov.b32 {b0, b1}, $4;
    cvt.rn.f16x2.e4m3x2 x01, b0;
    cvt.rn.f16x2.e4m3x2 x23, b1;
    mov.b32 {h0, h1}, x01;
    mov.b32 {h2, h3}, x23;
    cvt.f32.f16 $0, h0;
    cvt.f32.f16 $1, h1;
    cvt.f32.f16 $2, h2;
    cvt.f32.f16 $3, h3;
}""")


# two fp32 -> the bf16 pair (lo, hi), rounded
_PAIR_ASM = tl.constexpr("{ cvt.rn.bf16x2.f32 $0, $2, $1; }")


@triton.jit
def _bf16_pairs(lo, hi):
    """fp32 tensors lo, hi -> int32 bf16 pairs (lo in the low half): one instruction (compiled only)."""
    return tl.inline_asm_elementwise(_PAIR_ASM, "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _w8_codes(w, FMT: tl.constexpr, ASM: tl.constexpr):
    """int32 words [BN, NW] (4 codes each, k order) -> 4 fp32 tensors of code values (scales not applied)."""
    if ASM:
        if FMT == 0:
            q0, q1, q2, q3 = tl.inline_asm_elementwise(_W8_ASM, "=f,=f,=f,=f,r", [w],
                                                       dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                       is_pure=True, pack=1)
        else:
            q0, q1, q2, q3 = tl.inline_asm_elementwise(_F8_ASM, "=f,=f,=f,=f,r", [w],
                                                       dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                       is_pure=True, pack=1)
    else:
        if FMT == 0:
            q0 = (((w & 255) ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            q1 = ((((w >> 8) & 255) ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            q2 = ((((w >> 16) & 255) ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            q3 = ((((w >> 24) & 255) ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        else:
            q0 = (w & 255).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            q1 = ((w >> 8) & 255).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            q2 = ((w >> 16) & 255).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            q3 = ((w >> 24) & 255).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return q0, q1, q2, q3
