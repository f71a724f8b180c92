"""Split-K decode attention (q_len == 1) over the paged KV cache: a program owns (sequence, kv head, split);
splits partition each sequence's run-time length (flash-decoding), then a small kernel merges them by
log-sum-exp. The grid depends only on (B, Hk,
num_splits): CUDA-graph capturable with a fixed split count. In a mixed batch the decodes run here too
(VARLEN: rows found through cu_seqlens_q)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.attention_core import LOG2E, _attn_range, _dot_prec, f16_dot_applies


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, qk_scale,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, F16_DOT: tl.constexpr,
                   USE_PDL: tl.constexpr):
    if USE_PDL:                                              # launched early: wait for q and the new KV
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if VARLEN:                                               # mixed batch: only sequences with q_len == 1
        r = tl.load(cu_q_ptr + b).to(tl.int64)
        if tl.load(cu_q_ptr + b + 1) - r != 1:
            return
    else:
        r = b                                                # packed query row of this sequence
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N

    hh = tl.arange(0, BLOCK_M)                               # rows = heads of the group (padded)
    row_ok = hh < G
    head = kvh * G + hh
    offs_d = tl.arange(0, BD)
    q_mask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(q_ptr + r * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)                      # [M, BD]
    if F16_DOT:                                              # fp8 codes -> fp16 is one conversion, -> bf16 two
        q = q.to(tl.float16)

    bt = bt_ptr + b * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BD], tl.float32)
    acc, m_i, l_i = _attn_range(acc, m_i, l_i, q, k_base, v_base, bt, lo, full, seq_len, hh, qk_scale,
                                stride_kb, stride_kt, stride_vb, stride_vt,
                                BLOCK_N, BLOCK_SIZE, D, BD, False, False, DOT_PREC)
    acc, m_i, l_i = _attn_range(acc, m_i, l_i, q, k_base, v_base, bt, full, hi, seq_len, hh, qk_scale,
                                stride_kb, stride_kt, stride_vb, stride_vt,
                                BLOCK_N, BLOCK_SIZE, D, BD, True, False, DOT_PREC)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]      # empty split or padded sequence: zeros
    if NUM_SPLITS == 1:
        tl.store(o_ptr + r * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=q_mask)
    else:                                                    # partials [B, H, S, D] fp32, lse [B, H, S]
        part = (b * (G * tl.num_programs(1)) + head) * NUM_SPLITS + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), -1e30)
        tl.store(o_ptr + part[:, None] * D + offs_d[None, :], out, mask=q_mask)
        tl.store(lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(part_ptr, lse_ptr, o_ptr, cu_q_ptr, stride_ob, stride_oh,
                   NUM_SPLITS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, VARLEN: tl.constexpr,
                   USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if VARLEN:
        r = tl.load(cu_q_ptr + b).to(tl.int64)
        if tl.load(cu_q_ptr + b + 1) - r != 1:
            return
    else:
        r = b
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, NUM_SPLITS)
    lse = tl.load(lse_ptr + row * NUM_SPLITS + s)            # [S]
    w = tl.exp2(lse - tl.max(lse, 0))
    d = tl.arange(0, BD)
    o = tl.load(part_ptr + (row * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=d[None, :] < D)  # [S, BD]
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + r * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


# ---------------------------------------------------------------- launch configuration

@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4                                                 # interpreter: small, still exercises splits


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def decode_num_splits(batch: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
    """Split count (a power of two) for a decode batch; depends only on host sizes, never on tensors.
    Under CUDA graphs pass the same fixed max_seqlen_k (e.g. max_model_len) at capture and replay."""
    sms = _num_sms(torch.device(device))
    progs = max(1, batch * num_kv_heads)
    if progs >= DECODE_NO_SPLIT_PROGRAMS_PER_SM * sms:      # enough (seq, head) programs to fill the chip
        return 1
    want = triton.cdiv(DECODE_TARGET_PROGRAMS_PER_SM * sms, progs)
    cap = min(DECODE_MAX_SPLITS, max(1, max_seqlen_k // DECODE_MIN_SPLIT_TOKENS))
    s = max(1, min(want, cap))
    return 1 << (s.bit_length() - 1)                         # round down to a power of two


DECODE_NO_SPLIT_PROGRAMS_PER_SM = 2
DECODE_TARGET_PROGRAMS_PER_SM = 4
DECODE_MAX_SPLITS = 32
DECODE_MIN_SPLIT_TOKENS = 128


def _decode_config(gp: int, d: int, dtype: torch.dtype, device: torch.device, splits: int = 1,
                   cache_dtype: torch.dtype | None = None) -> dict:
    """Decode tiles, and f16_dot: an fp8 cache read by bf16 queries takes its products in fp16, since e4m3 codes
    convert to fp16 in one instruction and to bf16 in several, and the conversion, not the bytes, bounded the
    kernel (H200, 8B shape, 256 sequences of 2-4.6k tokens: 840 -> 547 us, sweep_decode_attention.py
    --kv-cache-dtype fp8)."""
    fp8 = cache_dtype == torch.float8_e4m3fn
    f16_dot = f16_dot_applies(dtype, cache_dtype)
    if device.type != "cuda":
        tiles = dict(BLOCK_N=32, num_warps=4, num_stages=1)
    elif dtype == torch.float32 or d > 128:
        tiles = dict(BLOCK_N=32, num_warps=4, num_stages=2)
    elif fp8 and d == 128 and splits == 1:
        tiles = dict(BLOCK_N=128, num_warps=4, num_stages=2)
    elif d == 128 and splits == 1:
        # H200, graph replays (bench_kernels.py --sweep --sections decode, 8B shape, --tp 1 and 2): a third stage
        # takes 3.5-4.9% off 128-256 sequences at 8 KV heads, 0-2.9% at 4, and leaves 64 equal; it needs the
        # shared memory of Hopper and newer
        tiles = dict(BLOCK_N=64, num_warps=4, num_stages=3 if _sm90_or_newer(device) else 2)
    else:
        tiles = dict(BLOCK_N=64, num_warps=2, num_stages=3)
    return dict(tiles, f16_dot=f16_dot)


# ---------------------------------------------------------------- launchers

def _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, cu_q, scale, B, S, cfg, out, pdl=False):
    """Grid (B, Hk, S). cu_q None: sequence b's query is row b; else rows come from cu_q and
    sequences with q_len != 1 are skipped. pdl: both kernels launch as programmatic dependents."""
    launch = {"launch_pdl": True} if pdl else {}
    H, D = q.shape[1], q.shape[2]
    Hk, bs = k_cache.shape[2], k_cache.shape[1]
    G = H // Hk
    BD = triton.next_power_of_2(D)
    varlen = cu_q is not None
    cu_q = cu_q if varlen else seq_lens                      # unused when not varlen
    if S > 1:
        part = torch.empty((B, H, S, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        dst, sob, soh = part, 0, 0
    else:
        lse, dst, sob, soh = out, out, out.stride(0), out.stride(1)
    _decode_kernel[(B, Hk, S)](
        q, k_cache, v_cache, dst, lse, block_tables, seq_lens, cu_q, scale * LOG2E,
        q.stride(0), q.stride(1), sob, soh, block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        G=G, BLOCK_M=max(16, triton.next_power_of_2(G)), BLOCK_N=cfg["BLOCK_N"], BLOCK_SIZE=bs, D=D, BD=BD,
        NUM_SPLITS=S, VARLEN=varlen, DOT_PREC=_dot_prec(q.dtype), USE_PDL=pdl,
        F16_DOT=cfg.get("f16_dot", False) and f16_dot_applies(q.dtype, k_cache.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch)
    if S > 1:
        _reduce_kernel[(B, H)](part, lse, out, cu_q, out.stride(0), out.stride(1),
                               NUM_SPLITS=S, D=D, BD=BD, VARLEN=varlen, USE_PDL=pdl,
                               num_warps=1 if BD * S <= 1024 else 4, **launch)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seqlen_k_hint: int, out: torch.Tensor | None = None,
                           num_splits: int | None = None, config: dict | None = None,
                           pdl: bool = False) -> torch.Tensor:
    """One query per sequence. q [B, H, D] (any strides, D contiguous); block_tables [B, W] int32;
    seq_lens [B] int32 (0 allowed: padded rows give zeros). Returns [B, H, D].
    No host syncs; the launch depends only on shapes, max_seqlen_k_hint and num_splits."""
    B, H, D = q.shape
    Hk = k_cache.shape[2]
    assert H % Hk == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B:
        S = num_splits or decode_num_splits(B, Hk, max_seqlen_k_hint, q.device)
        cfg = dict(_decode_config(H // Hk, D, q.dtype, q.device, S, k_cache.dtype), **(config or {}))
        _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, None, scale, B, S, cfg, out, pdl)
    return out
