"""Torch references of the paged attention kernels (kernels/paged_attention.py), for the tests: one sequence at
a time, reading exactly each sequence's seq_len keys."""
from __future__ import annotations

import torch

from engine.kernels.metadata import AttentionMetadata

def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain torch, one sequence at a time, reading exactly each sequence's seq_len keys (so garbage
    elsewhere in the cache cannot leak in). Computes in q's dtype: pass float64 inputs for a tight reference (an
    fp8 cache's codes are upcast to it)."""
    T, H, D = q.shape
    Hk, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros_like(q)
    cu = md.cu_seqlens_q.tolist()
    for i, (ql, sl) in enumerate(zip(md.q_lens, md.seq_lens_cpu)):
        pos = torch.arange(sl, device=q.device)
        blk = md.block_tables[i].long()[pos // bs]
        k = k_cache[blk, pos % bs].to(q.dtype).repeat_interleave(H // Hk, dim=1)      # [sl, H, D]
        v = v_cache[blk, pos % bs].to(q.dtype).repeat_interleave(H // Hk, dim=1)
        qi = q[cu[i]:cu[i] + ql]                                           # [ql, H, D]
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        causal = pos[None, :] <= (sl - ql + torch.arange(ql, device=q.device))[:, None]
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        out[cu[i]:cu[i] + ql] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale):
    B = q.shape[0]
    lens = seq_lens.tolist()
    md = AttentionMetadata(
        positions=seq_lens.long() - 1, slot_mapping=seq_lens.long(),
        cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=q.device), seq_lens=seq_lens,
        block_tables=block_tables, logits_indices=torch.arange(B, device=q.device), q_lens=[1] * B,
        seq_lens_cpu=lens, max_seqlen_q=1, max_seqlen_k=max(lens, default=0), block_size=k_cache.shape[1])
    return paged_attention_ref(q, k_cache, v_cache, md, scale)
