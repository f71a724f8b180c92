"""CUDA graphs: decode steps, speculative verify steps and self-speculative draft steps, replayed with static
buffers.

Decode graphs (one query per sequence) are captured per batch size; sizes follow vLLM: 1, 2, 4, 8, then every
8 up to 256, then every 16. A decode step of B sequences pads to the next captured size; padded rows read and
write only the null block 0. Every graph keeps its output alive, so graphs above LOGITS_GRAPH_MAX_BATCH end at
the final norm and the LM head runs after the replay (their float32 logits, [B, vocab] each, would hold tens
of GiB at a large vocabulary; one eager GEMM at that batch costs nothing that matters). The split count of the decode attention is fixed per size (computed from
max_model_len), so the launch never depends on run-time lengths.

With speculative decoding (`EngineConfig.spec_cuda_graphs`), steps whose sequences each compute at most
k+1 tokens (a verify step: the last token + up to k drafts; or a short prefill chunk riding along) replay a
graph per (batch bucket, Q) with Q = 2 .. num_speculative_tokens + 1: every sequence is padded to Q query
rows. Sequence i's real rows sit at padded rows i*Q .. i*Q + q_i - 1 and its context length is extended by
Q - q_i, so the causal mask inside the speculative tokens is unchanged for the real rows (each sees keys up
to its own position); padded rows write their K/V to the null block's slot 0 and only they see the key
positions past the real ones. Logits are computed for every padded row and the needed rows gathered after
the replay. Self-speculative drafting (the first `draft_layers` layers) replays decode-shaped graphs of its
own per batch size.

Mixed steps (`EngineConfig.mixed_cuda_graphs`: prefill chunks beside decodes, or any step the graphs above do
not take) replay a graph per token bucket T (key (T, MIXED, None)) over all max_num_seqs + 1 sequence slots:
the step's tokens are packed first, the padding tokens form one extra sequence (K/V to the null block's slot 0,
context in the null block), and the unused slots have q_len 0, so the attention kernels' grids depend on T
alone (kernels/paged_attention.py). The graph ends at the final norm; the LM head runs on the needed rows
after the replay. Steps longer than `mixed_cuda_graph_max_tokens` run eagerly.
"""
from __future__ import annotations

import bisect
import logging
from types import SimpleNamespace

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kernels.metadata import AttentionMetadata
from engine.worker.timing import NullTimer

log = logging.getLogger(__name__)


MIXED = 0                                   # the Q of a mixed-step key (T, MIXED, None)
LOGITS_GRAPH_MAX_BATCH = 256                # larger decode graphs return hidden states, not logits


def capture_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: every size below max_batch and the first at or above it (covers max_batch)."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s < max_batch] + [next((s for s in sizes if s >= max_batch), sizes[-1])]


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """Token buckets of mixed-step graphs: a padded step wastes at most 1/5 of its tokens above 64."""
    sizes = list(range(16, 257, 16)) + list(range(320, 1025, 64)) + list(range(1152, 8193, 128))
    return [s for s in sizes if s < max_tokens] + [max_tokens]      # a full token budget is a bucket


def stage_decode(bufs, input_ids: torch.Tensor, md: AttentionMetadata, P: int) -> None:
    """Copy a decode step of B <= P sequences into the first rows of static buffers (bufs.input_ids, positions,
    slots, seq_lens [N]; block_tables [N, max_blocks]); rows B..P-1 become length-1 sequences in the null block.
    Table columns past the step's width keep stale ids, which every length stops short of."""
    B, nb = md.num_seqs, md.block_tables.shape[1]
    bufs.input_ids[:B].copy_(input_ids)
    bufs.positions[:B].copy_(md.positions)
    bufs.slots[:B].copy_(md.slot_mapping)
    bufs.seq_lens[:B].copy_(md.seq_lens)
    bufs.block_tables[:B, :nb].copy_(md.block_tables)
    if P > B:
        bufs.input_ids[B:P].zero_()
        bufs.positions[B:P].zero_()
        bufs.slots[B:P].zero_()
        bufs.seq_lens[B:P].fill_(1)
        bufs.block_tables[B:P, 0].zero_()


class CudaGraphRunner:
    """Graphs keyed by (padded batch P, query rows per sequence Q, layers or None for all).
    capture=False runs the same padded static-buffer forward eagerly instead of replaying (no CUDA needed), so
    the padding layout can be checked on CPU with any kernels."""

    def __init__(self, runner, config: EngineConfig, capture: bool = True):
        self.runner = runner
        self.model = runner.model
        self.max_batch = min(config.kernel_config.cuda_graph_max_batch or 1024, config.scheduler_config.max_num_seqs)
        self.sizes = capture_sizes(self.max_batch)
        self.max_len = runner.max_model_len
        self.max_blocks = -(-self.max_len // runner.block_size)
        spec = config.speculative_config.speculative_method is not None and config.speculative_config.spec_cuda_graphs
        self.max_q = config.speculative_config.max_speculative_tokens + 1 if spec else 1
        # verify graphs: every Q up to num_speculative_tokens + 1, and the longest drafts' (num_speculative_tokens_max)
        # alone: a step in between is padded up to it
        self.spec_qs = sorted(set(range(2, config.speculative_config.num_speculative_tokens + 2)) | {self.max_q}) \
            if spec and self.max_q > 1 else []
        self.spec_sizes = capture_sizes(min(config.speculative_config.spec_cuda_graph_max_batch, self.max_batch)) \
            if spec else []
        self.draft_layers = min(config.speculative_config.draft_layers, runner.mcfg.num_layers) \
            if spec and config.speculative_config.speculative_method == "self" else None
        self.mixed_sizes = mixed_token_sizes(min(config.kernel_config.mixed_cuda_graph_max_tokens,
                                                 config.scheduler_config.max_num_batched_tokens)) \
            if config.kernel_config.mixed_cuda_graphs else []
        self.max_seqs = config.scheduler_config.max_num_seqs + 1  # + the sequence that owns a mixed step's padding
        self.mixed_splits = 1                       # decode splits inside mixed graphs (set at capture)
        self.use_graphs = capture
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.captured = False

    def release(self) -> None:
        """Destroy the graphs now. NCCL leaves a communicator (destroy or abort) only once every graph that
        captured one of its all-reduces is gone, so tensor parallelism releases them before the group."""
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.captured = False

    def keys(self) -> list[tuple[int, int, int | None]]:
        keys = [(B, 1, None) for B in self.sizes]
        keys += [(P, Q, None) for Q in self.spec_qs for P in self.spec_sizes]
        if self.draft_layers is not None:
            keys += [(P, 1, self.draft_layers) for P in self.spec_sizes]
        keys += [(T, MIXED, None) for T in self.mixed_sizes]
        return keys

    def _key(self, md: AttentionMetadata, num_layers: int | None) -> tuple | None:
        key = self._uniform_key(md, num_layers)
        if key is None and num_layers is None:
            key = self._mixed_key(md)
        return key

    def _mixed_key(self, md: AttentionMetadata) -> tuple | None:
        T = md.positions.shape[0]
        if not self.mixed_sizes or not 0 < T <= self.mixed_sizes[-1] or md.num_seqs >= self.max_seqs \
                or md.max_seqlen_k > self.max_len:
            return None
        return self.mixed_sizes[bisect.bisect_left(self.mixed_sizes, T)], MIXED, None

    def _uniform_key(self, md: AttentionMetadata, num_layers: int | None) -> tuple | None:
        """Decode, verify and draft steps: every sequence computes the same number of query rows once padded."""
        B, Q = md.num_seqs, md.max_seqlen_q
        if B == 0 or Q > self.max_q:
            return None
        if Q == 1:
            if md.num_seqs != md.logits_indices.shape[0] or md.max_seqlen_k > self.max_len:
                return None
            sizes = self.sizes if num_layers is None else self.spec_sizes
            if num_layers is not None and num_layers != self.draft_layers:
                return None
        else:
            Q = self.spec_qs[bisect.bisect_left(self.spec_qs, Q)]     # the captured Q at or above it
            if num_layers is not None or md.max_seqlen_k + Q - 1 > self.max_len:
                return None
            sizes = self.spec_sizes
        if not sizes or B > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, B)], Q, num_layers

    def can_run(self, md: AttentionMetadata, num_layers: int | None = None) -> bool:
        return self._key(md, num_layers) is not None

    def _static_md(self, P: int, Q: int, lens: list[int] | None = None) -> AttentionMetadata:
        """The metadata a graph is captured with: device tensors are the static buffers; host lengths are the
        fixed maximum (graph kernels never read them), or the padded lengths when replaying eagerly."""
        T = P * Q
        lens = lens or [self.max_len] * P
        return AttentionMetadata(
            positions=self.positions[:T], slot_mapping=self.slots[:T], cu_seqlens_q=self.cu_q[Q][:P + 1],
            seq_lens=self.seq_lens[:P], block_tables=self.block_tables[:P], logits_indices=self.logits_idx[:T],
            q_lens=[Q] * P, seq_lens_cpu=lens, max_seqlen_q=Q, max_seqlen_k=max(lens),
            block_size=self.runner.block_size)

    def _mixed_md(self, T: int, q_lens: list[int] | None = None, lens: list[int] | None = None) -> AttentionMetadata:
        """A mixed graph's metadata: T tokens over all sequence slots. Host lists: zeros at capture (the Triton
        path never reads them), the padded step's lengths when replaying eagerly."""
        P = self.max_seqs
        q_lens = q_lens or [0] * P
        lens = lens or [0] * P
        return AttentionMetadata(
            positions=self.positions[:T], slot_mapping=self.slots[:T], cu_seqlens_q=self.cu_mixed,
            seq_lens=self.seq_lens[:P], block_tables=self.block_tables[:P], logits_indices=self.logits_idx[:0],
            q_lens=q_lens, seq_lens_cpu=lens, max_seqlen_q=max(q_lens), max_seqlen_k=self.max_len,
            block_size=self.runner.block_size, mixed_splits=self.mixed_splits)

    @torch.inference_mode()
    def capture(self) -> None:
        dev = self.runner.device
        keys = sorted(self.keys(), key=lambda k: (-self._tokens(k), k[1], k[2] or 0))   # largest first: one pool
        N = max(self._tokens(k) for k in keys)
        rows = max(N, self.max_seqs)
        self.input_ids = torch.zeros(N, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(N, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(N, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((rows,), self.max_q, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=dev)
        ar = torch.arange(N + 1, dtype=torch.int32, device=dev)
        self.cu_q = {Q: ar * Q for Q in range(1, self.max_q + 1)}       # [N+1] per Q
        self.cu_mixed = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=dev)
        self.logits_idx = torch.arange(N, dtype=torch.int64, device=dev)
        if self.mixed_sizes and self.model.ops.name == "triton":
            from engine.kernels.decode_attention import decode_num_splits  # sized for a typical mixed step's decodes
            self.mixed_splits = decode_num_splits(32, self.model.cfg.num_kv_heads, self.max_len, dev)
        if not self.use_graphs:
            self.captured = True
            return
        saved_timer = self.model.timer
        self.model.timer = NullTimer()
        pool = None
        try:
            for key in keys:
                md = self._mixed_md(key[0]) if key[1] == MIXED else self._static_md(key[0], key[1])
                for _ in range(2):                  # warm-up: Triton compiles / autotunes outside capture
                    self._forward(key, md)
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[key] = self._forward(key, md)
                pool = g.pool()
                self.graphs[key] = g
            torch.cuda.synchronize(dev)
        finally:
            self.model.timer = saved_timer
        self.captured = True

    @staticmethod
    def _tokens(key: tuple) -> int:
        P, Q, _ = key
        return P if Q == MIXED else P * Q

    def _forward(self, key: tuple, md: AttentionMetadata) -> torch.Tensor:
        """-> logits of every row, or the final hidden states [T, hidden] of a mixed graph or a large decode one."""
        P, Q, layers = key
        hidden = self.model(self.input_ids[:self._tokens(key)], md, num_layers=layers)
        return hidden if self._hidden_out(key) else self.model.compute_logits(hidden)

    @staticmethod
    def _hidden_out(key: tuple) -> bool:
        P, Q, layers = key
        return Q == MIXED or (Q == 1 and layers is None and P > LOGITS_GRAPH_MAX_BATCH)

    def _replay(self, key: tuple, md: AttentionMetadata) -> torch.Tensor:
        if self.use_graphs:
            self.graphs[key].replay()
            return self.outputs[key]
        P, Q, _ = key                               # eager: host lengths as padded (torch kernels read them)
        B = md.num_seqs
        lens = [n + Q - q for n, q in zip(md.seq_lens_cpu, md.q_lens)] + [Q] * (P - B)
        return self._forward(key, self._static_md(P, Q, lens))

    def run(self, input_ids: torch.Tensor, md: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """-> float32 logits [len(md.logits_indices), vocab], as an eager forward would give."""
        if not self.captured:
            self.capture()
        key = self._key(md, num_layers)
        P, Q, _ = key
        B = md.num_seqs
        nb = md.block_tables.shape[1]
        md.graphed = self.use_graphs
        if Q == MIXED:
            return self._run_mixed(key, input_ids, md)
        if Q == 1:
            stage_decode(self, input_ids, md, P)
            out = self._replay(key, md)[:B]
            return self.model.compute_logits(out) if self._hidden_out(key) else out
        # packed row r = cu[i] + j of sequence i -> padded row i*Q + j; context extended by Q - q_i
        q_lens = np.asarray(md.q_lens, dtype=np.int64)
        T = int(q_lens.sum())
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        host = torch.from_numpy(np.concatenate([
            np.repeat(np.arange(B, dtype=np.int64) * Q - starts, q_lens) + np.arange(T, dtype=np.int64),
            Q - q_lens]))
        if self.runner.device.type == "cuda":
            host = host.pin_memory()
        d = host.to(self.runner.device, non_blocking=True)
        pad_rows, extend = d[:T], d[T:].to(torch.int32)                  # [T], [B]
        n = P * Q
        self.input_ids[:n].zero_()
        self.positions[:n].zero_()
        self.slots[:n].zero_()                      # padded rows: K/V to the null block's slot 0
        self.input_ids.index_copy_(0, pad_rows, input_ids)
        self.positions.index_copy_(0, pad_rows, md.positions)
        self.slots.index_copy_(0, pad_rows, md.slot_mapping)
        torch.add(md.seq_lens, extend, out=self.seq_lens[:B])
        self.block_tables[:B, :nb].copy_(md.block_tables)
        if P > B:                                   # padded sequences: Q rows in the null block
            self.seq_lens[B:P].fill_(Q)
            self.block_tables[B:P, :-(-Q // self.runner.block_size)].zero_()
        out = self._replay(key, md)                 # [P*Q, V]
        return out.index_select(0, pad_rows.index_select(0, md.logits_indices))

    def _run_mixed(self, key: tuple, input_ids: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Tokens [0, T) as packed; padding tokens [T, Tp) are sequence B's (null block); slots past B empty."""
        Tp = key[0]
        T, B, bs = input_ids.shape[0], md.num_seqs, self.runner.block_size
        nb = md.block_tables.shape[1]
        pad = Tp - T
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(md.positions)
        self.slots[:T].copy_(md.slot_mapping)
        if pad:
            self.input_ids[T:Tp].zero_()
            self.positions[T:Tp].zero_()
            self.slots[T:Tp].zero_()
            self.block_tables[B, :-(-pad // bs)].zero_()
        self.cu_mixed[:B + 1].copy_(md.cu_seqlens_q)
        self.cu_mixed[B + 1:].fill_(Tp)
        self.seq_lens[:B].copy_(md.seq_lens)
        self.seq_lens[B:self.max_seqs].zero_()
        self.seq_lens[B:B + 1].fill_(pad)
        self.block_tables[:B, :nb].copy_(md.block_tables)
        if self.use_graphs:
            self.graphs[key].replay()
            hidden = self.outputs[key]
        else:                                   # eager: host lengths as padded (torch kernels read them)
            rest = self.max_seqs - B - 1
            hidden = self._forward(key, self._mixed_md(Tp, md.q_lens + [pad] + [0] * rest,
                                                       md.seq_lens_cpu + [pad] + [0] * rest))
        if md.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, md.logits_indices))

    # ---- verify steps packed by the caller in the padded layout (engine/spec/fast_verify.py) ----------------
    def spec_key(self, B: int, Q: int, max_seq_len: int) -> tuple | None:
        """The verify graph for B sequences of at most Q query rows whose longest context is max_seq_len."""
        if not self.spec_sizes or not 2 <= Q <= self.max_q or B > self.spec_sizes[-1]:
            return None
        Q = self.spec_qs[bisect.bisect_left(self.spec_qs, Q)]         # the captured Q at or above it
        if max_seq_len + Q - 1 > self.max_len:
            return None
        return self.spec_sizes[bisect.bisect_left(self.spec_sizes, B)], Q, None

    def run_padded(self, key: tuple, i64: torch.Tensor, i32: torch.Tensor, width: int,
                   lens_cpu: list[int]) -> torch.Tensor:
        """Replay a verify graph from host inputs already in its padded layout (see the module doc):
        i64 = [input ids | positions | slots], P*Q each; i32 = [seq_lens P | block tables P*width];
        lens_cpu: the padded seq_lens (read only when replaying eagerly). -> logits [P*Q, V]."""
        if not self.captured:
            self.capture()
        P, Q, _ = key
        n = P * Q
        self.input_ids[:n].copy_(i64[:n], non_blocking=True)
        self.positions[:n].copy_(i64[n:2 * n], non_blocking=True)
        self.slots[:n].copy_(i64[2 * n:3 * n], non_blocking=True)
        self.seq_lens[:P].copy_(i32[:P], non_blocking=True)
        self.block_tables[:P, :width].copy_(i32[P:P + P * width].view(P, width), non_blocking=True)
        # (the lengths are padded already: as P sequences of Q rows, _replay extends none of them)
        return self._replay(key, SimpleNamespace(num_seqs=P, q_lens=[Q] * P, seq_lens_cpu=lens_cpu))
