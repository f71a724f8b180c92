"""Compile ahead every paged-attention kernel variant a real step can pick, so no step JIT-compiles mid-run."""
from __future__ import annotations

import itertools

import torch

from engine.kernels.metadata import AttentionMetadata
from engine.kernels.decode_attention import DECODE_MAX_SPLITS, DECODE_MIN_SPLIT_TOKENS, paged_attention_decode
from engine.kernels.paged_attention import paged_attention


def warmup_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, max_seqlen_k: int,
                    pdl: bool = False, q_dtype: torch.dtype | None = None) -> int:
    """Compile every kernel variant a real step can pick (prefill tile heights with and without decodes
    apart, decode split counts with and without varlen rows) on the null block 0, so no step pays a JIT
    compile mid-run. q_dtype: the model's (None: the cache's; an fp8 cache needs it). Returns the number of launches."""
    dev, dt = k_cache.device, q_dtype or k_cache.dtype
    bs, D = k_cache.shape[1], k_cache.shape[3]
    n = 64
    bt = torch.zeros(2, -(-n // bs), dtype=torch.int32, device=dev)
    splits, s = [], 1
    while s <= min(DECODE_MAX_SPLITS, max(1, max_seqlen_k // DECODE_MIN_SPLIT_TOKENS)):
        splits.append(s)
        s *= 2
    launches = 0
    for q_len in (64, 16, 8, 4, 2):                          # every prefill tile height (BLOCK_M)
        for with_decode in (False, True):
            q_lens = [q_len, 1] if with_decode else [q_len]
            B, T = len(q_lens), sum(q_lens)
            md = AttentionMetadata(
                positions=torch.zeros(T, dtype=torch.int64, device=dev), slot_mapping=torch.zeros(T, dtype=torch.int64, device=dev),
                cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev),
                seq_lens=torch.full((B,), n, dtype=torch.int32, device=dev), block_tables=bt[:B],
                logits_indices=torch.zeros(0, dtype=torch.int64, device=dev), q_lens=q_lens, seq_lens_cpu=[n] * B,
                max_seqlen_q=q_len, max_seqlen_k=n, block_size=bs)
            q = torch.randn(T, num_heads, D, dtype=dt, device=dev)
            for S in (splits if with_decode else [None]):
                paged_attention(q, k_cache, v_cache, md, 1.0, config={"decode_splits": S} if S else None)
                launches += 1
    for B in (1, 2):                                         # decode-only (eager), every split count
        q = torch.randn(B, num_heads, D, dtype=dt, device=dev)
        for S, p in itertools.product(splits, (False, True) if pdl else (False,)):
            paged_attention_decode(q, k_cache, v_cache, bt[:B], torch.full((B,), n, dtype=torch.int32, device=dev),
                                   1.0, n, num_splits=S, pdl=p)
            launches += 1
    return launches
