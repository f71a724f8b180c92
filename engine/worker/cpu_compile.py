"""Compiled CPU decode steps: the CPU's counterpart of cuda_graphs.py.

A decode-only step (one query per sequence) runs the whole forward (embedding, every layer, final norm, LM head)
as one TorchInductor C++ graph per padded batch size (1, 2, 4, 8, ... up to `cpu_compile_max_batch`), so the
~15 small elementwise ops of a layer (RMSNorm, RoPE, SiLU-and-mul, residual adds, the bf16 casts around the int4
GEMMs) fuse into a few loops; the GEMMs stay extern calls. The graph reads tensors only: the KV store and the
paged attention are one opaque op (torch_ops.rope_store_decode_attention) that reads the context lengths itself,
so one graph serves every context length. A step of B sequences pads to the next compiled size; padded rows
read and write only the null block 0.

The graphs compile at engine start (warmup), and TorchInductor caches them on disk (under ~/.cache/kvscope/inductor
unless TORCHINDUCTOR_CACHE_DIR is set): a later start of the same model loads them instead of compiling.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
import types
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.kernels.metadata import AttentionMetadata
from engine.worker.cuda_graphs import stage_decode
from engine.worker.timing import NullTimer

log = logging.getLogger(__name__)

CACHE_DIR = Path.home() / ".cache" / "kvscope" / "inductor"


def compile_sizes(max_batch: int) -> list[int]:
    """The compiled batch sizes: powers of two below max_batch and the first at or above it."""
    sizes = [1 << i for i in range(11)]
    return [s for s in sizes if s < max_batch] + [next(s for s in sizes if s >= max_batch)]


def _own_code(fn):
    """fn with a code object of its own: dynamo keeps compiled graphs per code object, and its guards skip the
    model's modules, so one engine's graphs must never serve another engine's model."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def use_kvscope_cache_dir() -> None:
    """TorchInductor's disk cache under ~/.cache/kvscope unless TORCHINDUCTOR_CACHE_DIR names another (torch sets
    the variable to its default the first time it asks)."""
    from torch._inductor.runtime.runtime_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE_DIR)


class CompiledDecode:
    """compile=False runs the same padded, tensor-only forward eagerly (the layout checked without compiling)."""

    def __init__(self, runner, config: EngineConfig, compile: bool = True):
        self.runner, self.model = runner, runner.model
        self.max_batch = min(config.kernel_config.cpu_compile_max_batch, config.scheduler_config.max_num_seqs)
        self.sizes = compile_sizes(self.max_batch)
        self.max_len = runner.max_model_len
        bs = runner.block_size
        self.max_blocks = -(-self.max_len // bs)
        N, dev = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(N, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(N, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(N, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(N, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(N, self.max_blocks, dtype=torch.int32, device=dev)
        self.compile_s: dict[int, float] = {}      # seconds each size took at warmup (compile or cache load)
        self.steps = 0                              # decode steps run through the graphs
        model = self.model

        def decode_forward(input_ids, positions, slots, seq_lens, block_tables):
            """[P] ids, positions, slots, lengths; [P, max_blocks] tables -> float32 logits [P, vocab]. The tensor-only
            path reads positions, slots, lengths and tables; cu_seqlens_q and logits_indices are placeholders."""
            md = AttentionMetadata(positions=positions, slot_mapping=slots, cu_seqlens_q=seq_lens, seq_lens=seq_lens,
                                   block_tables=block_tables, logits_indices=positions, q_lens=[], seq_lens_cpu=[],
                                   max_seqlen_q=1, max_seqlen_k=0, block_size=bs, tensor_only=True)
            return model.compute_logits(model(input_ids, md))

        if not compile:
            self.forward = decode_forward
            return
        use_kvscope_cache_dir()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(self.sizes))
        self.forward = torch.compile(_own_code(decode_forward), fullgraph=True, dynamic=False,
                                     options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                              "size_asserts": False})   # ~640 shape checks a step otherwise

    def can_run(self, md: AttentionMetadata) -> bool:
        B = md.num_seqs
        return (0 < B <= self.sizes[-1] and md.max_seqlen_q == 1 and md.logits_indices.shape[0] == B
                and md.positions.shape[0] == B and md.max_seqlen_k <= self.max_len and not md.prompt_logits)

    @torch.inference_mode()
    def compile(self) -> None:
        """Compile (or load from the disk cache) every size, through the null block."""
        saved, self.model.timer = self.model.timer, NullTimer()
        try:
            for P in self.sizes:
                t = time.perf_counter()
                self._call(P)
                self.compile_s[P] = time.perf_counter() - t
        finally:
            self.model.timer = saved
        log.info("compiled CPU decode steps for batch sizes %s in %.1f s", self.sizes, sum(self.compile_s.values()))

    def _call(self, P: int) -> torch.Tensor:
        return self.forward(self.input_ids[:P], self.positions[:P], self.slots[:P], self.seq_lens[:P],
                            self.block_tables[:P])

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """-> float32 logits [B, vocab], as an eager forward would give."""
        B = md.num_seqs
        P = self.sizes[bisect.bisect_left(self.sizes, B)]
        stage_decode(self, input_ids, md, P)
        saved, self.model.timer = self.model.timer, NullTimer()
        try:
            out = self._call(P)
        finally:
            self.model.timer = saved
        self.steps += 1
        return out[:B]
