"""Paged attention over a block-table KV cache [num_blocks, block_size, Hk, D].

Two kernels share one inner loop (online softmax in fp32, exp2 with the scale folded in):
- prefill/mixed: packed varlen queries, causal with offset; a program owns BQ consecutive queries of one
  sequence times one whole GQA group (rows = query x head, group padded to a power of two), so every
  K/V tile is loaded once per group. Programs find their sequence by binary search over cu_seqlens_q:
  the grid (T // BQ + B, Hk) depends only on host sizes.
- decode (q_len == 1): the split-K kernel of decode_attention.py. In a mixed batch the decodes run there
  too and the prefill kernel skips them, so a long decode is not computed with a 128-row tile that holds
  one real query.
A mixed step replayed from a CUDA graph (md.mixed_splits > 0) launches both kernels at sizes fixed by its
tensors' shapes; sequences with q_len 0 (unused slots) own one program that returns at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention_core import LOG2E, _attn_range, _dot_prec, f16_dot_applies
from engine.kernels.decode_attention import _decode_config, _launch_decode, decode_num_splits, paged_attention_decode
from engine.kernels.metadata import AttentionMetadata


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])   # run-time sizes: no recompile per value
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, num_seqs, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    G: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    SKIP_DECODES: tl.constexpr, DOT_PREC: tl.constexpr, F16_DOT: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # sequence i owns programs [cu_q[i] // BQ + i, cu_q[i+1] // BQ + i + 1): at least cdiv(q_len, BQ)
    # A trailing sequence with no queries (a mixed CUDA graph's unused slots: cu_q[j] = T) owns just program
    # T // BQ + j: found with two loads, not a binary search over every slot
    total = tl.load(cu_q_ptr + num_seqs)
    j = pid - total // BQ
    if (j >= 0) & (j < num_seqs):
        if tl.load(cu_q_ptr + j) == total:
            return
    lo = pid * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu_q_ptr + mid) // BQ + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    tile = (pid - q_start // BQ - seq) * BQ                  # first query of this tile in its sequence
    skip = tile >= q_len
    if SKIP_DECODES:                                         # q_len == 1: the decode kernel's
        skip = skip | (q_len == 1)
    if skip:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first = seq_len - q_len + tile                           # absolute position of the tile's first query

    offs_m = tl.arange(0, BLOCK_M)
    tok, hh = offs_m // GP, offs_m % GP                      # row = query token x head of the group
    row_ok = (tok < BQ) & (hh < G) & (tile + tok < q_len)
    row_pos = first + tok
    head = kvh * G + hh
    offs_d = tl.arange(0, BD)
    rows = (q_start + tile + tok).to(tl.int64)
    io_mask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)                     # [M, BD]
    if F16_DOT:                                              # fp8 codes -> fp16 is one conversion, -> bf16 two
        q = q.to(tl.float16)

    bt = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BD], tl.float32)
    full = (first + 1) // BLOCK_N * BLOCK_N                  # keys every row of the tile sees
    end = tl.minimum(first + BQ, seq_len)
    acc, m_i, l_i = _attn_range(acc, m_i, l_i, q, k_base, v_base, bt, 0, full, seq_len, row_pos, qk_scale,
                                stride_kb, stride_kt, stride_vb, stride_vt,
                                BLOCK_N, BLOCK_SIZE, D, BD, False, True, DOT_PREC)
    acc, m_i, l_i = _attn_range(acc, m_i, l_i, q, k_base, v_base, bt, full, end, seq_len, row_pos, qk_scale,
                                stride_kb, stride_kt, stride_vb, stride_vt,
                                BLOCK_N, BLOCK_SIZE, D, BD, True, True, DOT_PREC)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=io_mask)


# ---------------------------------------------------------------- launch configuration

def _prefill_config(gp: int, d: int, max_q: int, dtype: torch.dtype, device: torch.device,
                    cache_dtype: torch.dtype | None = None) -> dict:
    """Prefill tiles, and f16_dot (attention_core.f16_dot_applies) as in _decode_config."""
    f16_dot = f16_dot_applies(dtype, cache_dtype)
    if device.type != "cuda":
        tiles = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    elif dtype == torch.float32 or d > 128:
        tiles = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    else:
        bm = min(128, max(16, triton.next_power_of_2(max_q) * gp))   # short queries (spec verify): smaller tiles
        # 128-key tiles pay at head_dim 128 with a cache in the model's dtype (H200 sweep in performance.md)
        bn = 128 if bm >= 128 and d == 128 and cache_dtype in (None, dtype) else 64
        tiles = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=8 if bm >= 128 else 4, num_stages=3)
    return dict(tiles, f16_dot=f16_dot)


# ---------------------------------------------------------------- launchers

def _launch_prefill(q, k_cache, v_cache, md, scale, B, pcfg, out, skip_decodes):
    """The prefill kernel over md's B sequences: grid (T // BQ + B, Hk), T = q.shape[0]."""
    T, H, D = q.shape
    Hk, bs = k_cache.shape[2], k_cache.shape[1]
    G = H // Hk
    GP = triton.next_power_of_2(G)
    BQ = max(1, pcfg["BLOCK_M"] // GP)
    _prefill_kernel[(T // BQ + B, Hk)](
        q, k_cache, v_cache, out, md.block_tables, md.seq_lens, md.cu_seqlens_q, B, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), md.block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        G=G, GP=GP, BQ=BQ, BLOCK_M=max(16, BQ * GP), BLOCK_N=pcfg["BLOCK_N"], BLOCK_SIZE=bs, D=D,
        BD=triton.next_power_of_2(D), SKIP_DECODES=skip_decodes, DOT_PREC=_dot_prec(q.dtype),
        F16_DOT=pcfg.get("f16_dot", False) and f16_dot_applies(q.dtype, k_cache.dtype),
        num_warps=pcfg["num_warps"], num_stages=pcfg["num_stages"])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                    config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """Causal attention of packed varlen queries over paged KV; same contract as torch_ops.paged_attention.
    q [T, H, D] (any strides, D contiguous) -> [T, H, D]. Decode-only batches take the split-K kernel;
    in mixed batches the decodes take it too (config: decodes_apart=False keeps them in the prefill
    kernel, decode_splits=N forces their split count; other keys tune the prefill kernel). pdl: decode-only
    batches launch as programmatic dependents (Hopper+, compiled Triton)."""
    if md.mixed_splits:
        return _paged_attention_graphed(q, k_cache, v_cache, md, scale, out)
    T, H, D = q.shape
    Hk = k_cache.shape[2]
    G = H // Hk
    B = md.num_seqs
    cfg = dict(config or {})
    apart, dec_splits = cfg.pop("decodes_apart", True), cfg.pop("decode_splits", None)
    if md.max_seqlen_q == 1 and T == B and not cfg:
        return paged_attention_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale,
                                      md.max_seqlen_k, out=out, num_splits=dec_splits, pdl=pdl)
    assert H % Hk == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    n_dec = sum(1 for n in md.q_lens if n == 1) if apart else 0
    max_q = max((n for n in md.q_lens if n != 1 or not n_dec), default=1)
    if n_dec < B:
        pcfg = dict(_prefill_config(triton.next_power_of_2(G), D, max_q, q.dtype, q.device, k_cache.dtype), **cfg)
        _launch_prefill(q, k_cache, v_cache, md, scale, B, pcfg, out, skip_decodes=n_dec > 0)
    if n_dec:
        S = dec_splits or decode_num_splits(n_dec, Hk, md.max_seqlen_k, q.device)
        _launch_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, scale, B, S,
                       _decode_config(G, D, q.dtype, q.device, S, k_cache.dtype), out)
    return out


def _paged_attention_graphed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                             scale: float, out: torch.Tensor | None) -> torch.Tensor:
    """paged_attention for a mixed step inside a CUDA graph: T (padded) tokens over B = seq_lens.shape[0]
    sequence slots; the prefill kernel skips decodes, the decode kernel (md.mixed_splits splits) everything else."""
    T, H, D = q.shape
    Hk = k_cache.shape[2]
    G = H // Hk
    B = md.seq_lens.shape[0]
    assert H % Hk == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    pcfg = _prefill_config(triton.next_power_of_2(G), D, T, q.dtype, q.device, k_cache.dtype)
    _launch_prefill(q, k_cache, v_cache, md, scale, B, pcfg, out, skip_decodes=True)
    _launch_decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_seqlens_q, scale, B, md.mixed_splits,
                   _decode_config(G, D, q.dtype, q.device, md.mixed_splits, k_cache.dtype), out)
    return out
