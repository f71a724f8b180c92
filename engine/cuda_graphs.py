"""CUDA graphs for decode-only steps: one graph per captured batch size, replayed with static buffers.

Capture sizes follow vLLM: 1, 2, 4, 8, then every 8 up to 256, then every 16. A decode step of B
sequences pads to the next captured size; padded rows read and write only the null block 0. The split
count of the decode attention is fixed per size (computed from max_model_len), so the launch never
depends on run-time lengths. Steps with prefill chunks run eagerly.
"""
from __future__ import annotations

import bisect
import logging

import torch

from .config import EngineConfig
from .kernels.metadata import AttentionMetadata
from .timing import NullTimer

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s <= max_batch] or [1]


class CudaGraphRunner:
    def __init__(self, runner, config: EngineConfig):
        self.runner = runner
        self.model = runner.model
        self.max_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
        self.sizes = capture_sizes(self.max_batch)
        self.max_len = runner.max_model_len
        self.max_blocks = -(-self.max_len // runner.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captured = False

    def can_run(self, md: AttentionMetadata) -> bool:
        return md.decode_only and md.num_seqs == len(md.logits_indices) and md.num_seqs <= self.sizes[-1] \
            and md.max_seqlen_k <= self.max_len

    def _static_md(self, B: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:B], slot_mapping=self.slots[:B], cu_seqlens_q=self.cu_q[:B + 1],
            seq_lens=self.seq_lens[:B], block_tables=self.block_tables[:B], logits_indices=self.logits_idx[:B],
            q_lens=[1] * B, seq_lens_cpu=[self.max_len] * B, max_seqlen_q=1, max_seqlen_k=self.max_len,
            block_size=self.runner.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        dev, N = self.runner.device, self.sizes[-1]
        self.input_ids = torch.zeros(N, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(N, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(N, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(N, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(N, self.max_blocks, dtype=torch.int32, device=dev)
        self.cu_q = torch.arange(N + 1, dtype=torch.int32, device=dev)
        self.logits_idx = torch.arange(N, dtype=torch.int64, device=dev)
        saved_timer = self.model.timer
        self.model.timer = NullTimer()
        pool = None
        try:
            for B in reversed(self.sizes):          # largest first, so smaller graphs reuse its pool
                md = self._static_md(B)
                for _ in range(2):                  # warm-up: Triton compiles / autotunes outside capture
                    self._forward(B, md)
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[B] = self._forward(B, md)
                pool = g.pool()
                self.graphs[B] = g
            torch.cuda.synchronize(dev)
        finally:
            self.model.timer = saved_timer
        self.captured = True

    def _forward(self, B: int, md: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.input_ids[:B], md)
        return self.model.compute_logits(hidden)

    def run(self, input_ids: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if not self.captured:
            self.capture()
        B = md.num_seqs
        P = self.sizes[bisect.bisect_left(self.sizes, B)]
        nb = md.block_tables.shape[1]
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(md.positions)
        self.slots[:B].copy_(md.slot_mapping)
        self.seq_lens[:B].copy_(md.seq_lens)
        self.block_tables[:B, :nb].copy_(md.block_tables)
        if P > B:                                   # padded rows: length 1 in the null block
            self.input_ids[B:P].zero_()
            self.positions[B:P].zero_()
            self.slots[B:P].zero_()
            self.seq_lens[B:P].fill_(1)
            self.block_tables[B:P, 0].zero_()
        self.graphs[P].replay()
        md.graphed = True
        return self.outputs[P][:B]
