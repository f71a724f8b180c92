"""AttentionMetadata: how one step's packed tokens map onto sequences and the paged KV pool."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # device tensors
    positions: torch.Tensor        # [T] int64, position of each packed token in its sequence
    slot_mapping: torch.Tensor     # [T] int64, block_id * block_size + offset where the token's K/V go
    cu_seqlens_q: torch.Tensor     # [B+1] int32, packed query offsets per sequence
    seq_lens: torch.Tensor         # [B] int32, context length per sequence including this step's tokens
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0
    logits_indices: torch.Tensor   # [L] int64, packed rows whose logits are needed
    # host-side copies (no device sync needed to plan work)
    q_lens: list[int]
    seq_lens_cpu: list[int]
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    graphed: bool = False          # set when the step was replayed from a CUDA graph
    prompt_logits: list | None = None  # (seq index, first logits row, first position, rows): prompt-logprob rows
    mixed_splits: int = 0          # > 0: a mixed step captured in a CUDA graph (padded tokens, seq_lens.shape[0]
    #                                sequence slots): attention launches depend on tensor shapes only, and
    #                                decodes use this many splits; the host lists are not read

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1
