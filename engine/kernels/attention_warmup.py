"""Compile ahead every paged-attention kernel variant a real step can pick, so no step JIT-compiles mid-run."""
from __future__ import annotations

import itertools

import torch

from engine.kernels.metadata import AttentionMetadata
from engine.kernels.decode_attention import DECODE_MAX_SPLITS, DECODE_MIN_SPLIT_TOKENS, paged_attention_decode
from engine.kernels.paged_attention import (DENSE_MIN_TOKENS, DENSE_PAD, dense_applies, dense_attention,
                                            paged_attention)


def _metadata(q_lens: list[int], seq_lens: list[int], bt: torch.Tensor, bs: int) -> AttentionMetadata:
    """Sequences whose every key sits in the null block 0 (bt: zeros, a row per sequence)."""
    dev, B, T = bt.device, len(q_lens), sum(q_lens)
    return AttentionMetadata(
        positions=torch.zeros(T, dtype=torch.int64, device=dev), slot_mapping=torch.zeros(T, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_tables=bt[:B],
        logits_indices=torch.zeros(0, dtype=torch.int64, device=dev), q_lens=q_lens, seq_lens_cpu=seq_lens,
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), block_size=bs)


def warmup_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, max_seqlen_k: int,
                    pdl: bool = False, q_dtype: torch.dtype | None = None) -> int:
    """Compile every kernel variant a real step can pick (prefill tile heights with and without decodes
    apart and with and without dense prompts beside, decode split counts with and without varlen rows) on the
    null block 0, so no step pays a JIT compile mid-run. q_dtype: the model's (None: the cache's; an fp8 cache
    needs it). Returns the number of launches."""
    dev, dt = k_cache.device, q_dtype or k_cache.dtype
    bs, D = k_cache.shape[1], k_cache.shape[3]
    n = 64
    bt = torch.zeros(3, -(-DENSE_PAD // bs), dtype=torch.int32, device=dev)
    splits, s = [], 1
    while s <= min(DECODE_MAX_SPLITS, max(1, max_seqlen_k // DECODE_MIN_SPLIT_TOKENS)):
        splits.append(s)
        s *= 2
    dense_sides = (False, True) if dense_applies(dev, dt, k_cache.dtype) else (False,)
    launches = 0
    for q_len, with_decode, dense in itertools.product((64, 16, 8, 4, 2), (False, True), dense_sides):
        q_lens = [q_len] + [1] * with_decode + [DENSE_PAD] * dense      # every prefill tile height (BLOCK_M)
        seq_lens = [n] + [n] * with_decode + [DENSE_PAD] * dense
        md = _metadata(q_lens, seq_lens, bt, bs)
        q = torch.randn(sum(q_lens), num_heads, D, dtype=dt, device=dev)
        for S in (splits if with_decode else [None]):
            cfg = {"dense_min_tokens": DENSE_PAD if dense else 0} | ({"decode_splits": S} if S else {})
            paged_attention(q, k_cache, v_cache, md, 1.0, config=cfg)
            launches += 1
    for B in (1, 2):                                         # decode-only (eager), every split count
        q = torch.randn(B, num_heads, D, dtype=dt, device=dev)
        for S, p in itertools.product(splits, (False, True) if pdl else (False,)):
            paged_attention_decode(q, k_cache, v_cache, bt[:B], torch.full((B,), n, dtype=torch.int32, device=dev),
                                   1.0, n, num_splits=S, pdl=p)
            launches += 1
    return launches


def warmup_dense(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, longest: int,
                 q_dtype: torch.dtype) -> int:
    """Run dense attention once at every padded length a fresh prompt of DENSE_MIN_TOKENS..longest tokens can
    take, so torch plans its fused kernel (cuDNN builds a plan per shape) before the first request. Returns the
    number of lengths (0 where dense attention does not apply)."""
    dev, bs, D = k_cache.device, k_cache.shape[1], k_cache.shape[3]
    if not dense_applies(dev, q_dtype, k_cache.dtype):
        return 0
    lengths = range(-(-DENSE_MIN_TOKENS // DENSE_PAD) * DENSE_PAD, longest + 1, DENSE_PAD)
    for L in lengths:
        bt = torch.zeros(1, -(-L // bs), dtype=torch.int32, device=dev)
        q = torch.randn(L, num_heads, D, dtype=q_dtype, device=dev)
        dense_attention(q, k_cache, v_cache, _metadata([L], [L], bt, bs), 1.0, torch.empty_like(q), [0])
    return len(lengths)
