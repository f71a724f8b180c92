"""What the paged attention kernels share: the online-softmax inner loop over a key range of one sequence and
kv head (fp32 accumulation, exp2 with the scale folded in, keys found through the block table). K/V tiles are
upcast to q's dtype as loaded: a no-op for a cache in the model's dtype, the dequantization of an fp8 cache
(codes at scale 1.0)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _attn_range(acc, m_i, l_i, q, k_base, v_base, bt_ptr, lo, hi, seq_len, row_pos, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # acc [M, BD], m_i/l_i [M] (log2 domain), q [M, BD]; keys [lo, hi) of one sequence and kv head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BD)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n                                                  # [BN] key positions
        if MASKED:
            blk = tl.load(bt_ptr + n // BLOCK_SIZE, mask=n < seq_len, other=0)
        else:
            blk = tl.load(bt_ptr + n // BLOCK_SIZE)
        blk = blk.to(tl.int64)
        k_ptrs = k_base + (blk * stride_kb + (n % BLOCK_SIZE) * stride_kt)[:, None] + offs_d[None, :]
        v_ptrs = v_base + (blk * stride_vb + (n % BLOCK_SIZE) * stride_vt)[:, None] + offs_d[None, :]
        if MASKED or BD != D:
            kv_mask = (n[:, None] < seq_len) & (offs_d[None, :] < D)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)        # [BN, BD]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        else:
            k = tl.load(k_ptrs).to(q.dtype)
            v = tl.load(v_ptrs).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale     # [M, BN]
        if MASKED:
            ok = (n < seq_len)[None, :]
            if CAUSAL:
                ok = ok & (n[None, :] <= row_pos[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


def f16_dot_applies(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Products in fp16 for an fp8 cache read by bf16 queries: e4m3 codes convert to fp16 in one instruction and
    to bf16 in several (fp16 holds every code exactly)."""
    return cache_dtype == torch.float8_e4m3fn and q_dtype == torch.bfloat16


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
