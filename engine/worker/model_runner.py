"""ModelRunner: owns the model and the KV pool; packs a scheduled step into tensors and runs it."""
from __future__ import annotations

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kernels import cpu_kernels
from engine.kernels.kv_transfer import blocks_view, kv_transfer, kv_transfer_ref, pool_view
from engine.kernels.metadata import AttentionMetadata
from engine.models.config import ModelArchConfig
from engine.core.scheduler import SchedulerOutput
from engine.worker.timing import NullTimer


SWAP_STAGING_BLOCKS = 256      # blocks out staged on the device (their copy to the host overlaps the forward)


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: fp8 e4m3 codes (kv_cache_dtype="fp8") or the model's dtype."""
    return torch.float8_e4m3fn if config.cache_config.kv_cache_dtype == "fp8" else dtype


def kv_bytes_per_block(mcfg: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """dtype: the pool's element type (kv_cache_dtype)."""
    return 2 * mcfg.num_layers * block_size * mcfg.num_kv_heads * mcfg.head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model, mcfg: ModelArchConfig, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, num_blocks: int, max_model_len: int, num_host_blocks: int = 0):
        self.model, self.mcfg, self.config = model, mcfg, config
        self.device, self.dtype = device, dtype
        self.kv_dtype = kv_cache_dtype(config, dtype)
        self.block_size = config.cache_config.block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        # [2, layers, num_blocks, block_size, Hk, D]; Hk: this rank's KV heads (model.cfg is its shard)
        self.kv_cache = torch.zeros(2, mcfg.num_layers, num_blocks, self.block_size, model.cfg.num_kv_heads,
                                    mcfg.head_dim, dtype=self.kv_dtype, device=device)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.v_cache = self.kv_cache[1, i]
        # the host tier: [num_host_blocks, 2, layers, block_size, Hk, D], a block contiguous; pinned on cuda, where
        # the block copies (kv_transfer) read and write it directly, the copies out on a side stream
        self.host_kv = torch.zeros(num_host_blocks, *self.kv_cache.shape[:2], *self.kv_cache.shape[3:],
                                   dtype=self.kv_dtype, pin_memory=device.type == "cuda") if num_host_blocks else None
        self.copy_stream = torch.cuda.Stream(device) if num_host_blocks and device.type == "cuda" else None
        self.bytes_swapped = [0, 0]     # (out, in) since the last pop_swap_bytes()
        # the block copies' views of the pool and the tier (they hold both: released with them)
        self.pool_blocks, self.host_blocks = (pool_view(self.kv_cache), blocks_view(self.host_kv)) \
            if num_host_blocks else (None, None)
        if self.copy_stream is not None:    # compile the block copies now, not in the first step that swaps
            self.swap_blocks([(0, 0)], [])
            self.swap_blocks([], [(0, 0)])  # (block 0 round trips: its content is unchanged)
            self.bytes_swapped = [0, 0]
        self.timer = NullTimer()
        self.graphs = None  # CUDA graph runner, attached by the engine on cuda
        self.executor = None  # tensor parallelism, on rank 0: sends every forward's plan to the other ranks
        self._graph_forwards = 0        # graph-eligible forwards run under an enabled timer
        self._sampling = False          # this step runs its graph-eligible forwards eagerly, timed
        self._sampled = False           # ... and did so since the last pop_timing_sampled()
        if device.type == "cpu":
            cpu_kernels.prepare()     # the C++ decode attention: loaded, or built in the background

    def set_timer(self, timer) -> None:
        """At the start of each step: the timer its regions go to."""
        self.timer = timer
        self.model.timer = timer
        self._sampling = False

    def pop_timing_sampled(self) -> bool:
        s, self._sampled = self._sampled, False
        return s

    def _timed_eagerly(self) -> bool:
        """A graph-eligible forward: replayed (untimed: a graph records no regions), except every
        graph_timing_interval-th one, whose step then runs all its forwards eagerly under the timer."""
        n = self.config.observability_config.graph_timing_interval
        if not self.timer.enabled or not n:
            return False
        if not self._sampling:
            self._graph_forwards += 1
            if self._graph_forwards % n:
                return False
            self._sampling = True
        self._sampled = True
        return True

    # ---- packing -------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, sample_mask: list[bool], extra_logits: list[int] | None = None,
                in_flight: int = 0) -> tuple[torch.Tensor, AttentionMetadata]:
        """Pack the step: input ids [T], and metadata. Each sequence computes tokens
        [computed_before, computed_before + num_new) of its token_ids (+ draft tokens at the end).
        extra_logits[i] = how many positions before the last also need logits (verification). The first
        `in_flight` sequences decode a token still on the device: their ids are left 0 for the caller to fill."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        q_lens, seq_lens = [], []
        prompt_logits = []
        max_blocks = 0
        for i, (seq, n, start) in enumerate(zip(sched.seqs, sched.num_new_tokens, sched.computed_before)):
            end = start + n
            bt = seq.block_table
            if n == 1 and not seq.spec_token_ids:           # a plain decode: no numpy round trip
                ids.append(seq.token_ids[start] if i >= in_flight else 0)
                positions.append(start)
                slots.append(bt[start // bs] * bs + start % bs)
            else:
                toks = seq.token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.token_ids
                ids.extend(toks[start:end])
                pos = np.arange(start, end, dtype=np.int64)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(bt, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            off = len(ids) - 1
            last = min(end, seq.num_prompt_tokens - 1)      # logits at p score prompt token p + 1
            if seq.prompt_logprobs is not None and start < last:
                prompt_logits.append((i, len(logits_idx), start, last - start))
                logits_idx.extend(range(off - n + 1, off - n + 1 + last - start))
            if sample_mask[i]:
                k = extra_logits[i] if extra_logits else 0
                logits_idx.extend(range(off - k, off + 1))
            q_lens.append(n)
            seq_lens.append(end)
            if len(bt) > max_blocks:
                max_blocks = len(bt)
        B, T, L = len(sched.seqs), len(ids), len(logits_idx)
        W = max(max_blocks, 1)
        # One host buffer, one copy to the device (a pageable copy per tensor would each wait for the GPU).
        # Segments start at even int64 offsets: Triton specializes pointers on 16-byte alignment, and a
        # misaligned view would compile new kernel variants mid-run.
        # [ids T | positions T | slots T | logits_idx L | cu_seqlens B+1 | seq_lens B | tables B*W]
        sizes = (T, T, T, L, B + 1, B, B * W)
        offs = [0]
        for n in sizes:
            offs.append(offs[-1] + n + (n & 1))
        buf = np.zeros(offs[-1], dtype=np.int64)
        o_ids, o_pos, o_slot, o_lg, o_cu, o_len, o_tab = offs[:7]
        buf[o_ids:o_ids + T], buf[o_pos:o_pos + T], buf[o_slot:o_slot + T] = ids, positions, slots
        buf[o_lg:o_lg + L] = logits_idx
        np.cumsum(q_lens, out=buf[o_cu + 1:o_cu + B + 1])
        buf[o_len:o_len + B] = seq_lens
        tables = buf[o_tab:o_tab + B * W].reshape(B, W)
        for i, seq in enumerate(sched.seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        host = torch.from_numpy(buf)
        if self.device.type == "cuda":
            host = host.pin_memory()
        d = host.to(self.device, non_blocking=True)
        md = AttentionMetadata(
            positions=d[o_pos:o_pos + T], slot_mapping=d[o_slot:o_slot + T],
            cu_seqlens_q=d[o_cu:o_cu + B + 1].to(torch.int32), seq_lens=d[o_len:o_len + B].to(torch.int32),
            block_tables=d[o_tab:o_tab + B * W].view(B, W).to(torch.int32), logits_indices=d[o_lg:o_lg + L],
            q_lens=q_lens, seq_lens_cpu=seq_lens,
            max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), block_size=bs,
            prompt_logits=prompt_logits or None,
        )
        input_ids = d[o_ids:o_ids + T]
        return input_ids, md

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run each kernel variant once (prefill tile sizes, decode) through the null block 0, so no real
        step pays for a compile; every slot written is in block 0."""
        dev, bs = self.device, self.block_size
        n = 64 if dev.type == "cuda" else 8
        nb = -(-n // bs)
        for q in ((64, 16, 8, 4, 1) if dev.type == "cuda" else (8, 1)):
            md = AttentionMetadata(
                positions=torch.arange(n - q, n, device=dev), slot_mapping=torch.arange(n - q, n, device=dev) % bs,
                cu_seqlens_q=torch.tensor([0, q], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                block_tables=torch.zeros(1, nb, dtype=torch.int32, device=dev),
                logits_indices=torch.tensor([q - 1], device=dev), q_lens=[q], seq_lens_cpu=[n],
                max_seqlen_q=q, max_seqlen_k=n, block_size=bs)
            self.execute(torch.ones(q, dtype=torch.int64, device=dev), md)
        self.warmup_attention()

    def warmup_attention(self) -> None:
        """Compile the decode-attention variants of every length up front (no collectives: each rank alone)."""
        if self.device.type == "cuda" and self.model.ops.name == "triton":
            from engine.kernels.attention_warmup import warmup_variants
            layer = self.model.model.layers[0].self_attn
            warmup_variants(layer.k_cache, layer.v_cache, self.model.cfg.num_heads, self.max_model_len,
                            pdl=self.model.gemv_pdl, q_dtype=self.dtype)

    # ---- the host tier -------------------------------------------------------------------------
    @torch.inference_mode()
    def swap_blocks(self, blocks_out: list[tuple[int, int]], blocks_in: list[tuple[int, int]]) -> None:
        """Run a step's block copies before its forward: (device, host) pairs out, then (host, device) in (the
        scheduler may have refilled a block it freed in the same step). One kv_transfer launch per direction: on
        cuda the blocks out are gathered into a staging buffer on the step's stream and reach the pinned host tier
        on a side stream while the forward runs; the blocks in are read from the host before it."""
        if not blocks_out and not blocks_in:
            return
        n_out, n_in = len(blocks_out), len(blocks_in)
        pool, host = self.pool_blocks, self.host_blocks
        n_staged = n_out if n_out <= SWAP_STAGING_BLOCKS else 0
        # one index tensor, split below: out (device, host), in (host, device), and the staging buffer's rows
        idx = torch.tensor([d for d, _ in blocks_out] + [h for _, h in blocks_out] + [h for h, _ in blocks_in]
                           + [d for _, d in blocks_in] + list(range(n_staged)), dtype=torch.int32)
        sizes = [n_out, n_out, n_in, n_in, n_staged]
        self.bytes_swapped[0] += n_out * host.block * 4
        self.bytes_swapped[1] += n_in * host.block * 4
        if self.copy_stream is None:
            out_dev, out_host, in_host, in_dev, _ = idx.split(sizes)
            kv_transfer_ref(pool, host, out_dev, out_host)
            kv_transfer_ref(host, pool, in_host, in_dev)
            return
        idx = idx.pin_memory().to(self.device, non_blocking=True)
        out_dev, out_host, in_host, in_dev, rows = idx.split(sizes)
        main, side = torch.cuda.current_stream(self.device), self.copy_stream
        staged = None
        if n_out > n_staged or n_in:
            main.wait_stream(side)                   # earlier steps' blocks out have reached the host
        if n_staged:
            staged = torch.empty((n_staged, *self.host_kv.shape[1:]), dtype=self.kv_dtype, device=self.device)
            kv_transfer(pool, blocks_view(staged), out_dev, rows)
        elif n_out:                                  # (a long preemption: straight to the host, no staging)
            kv_transfer(pool, host, out_dev, out_host)
        kv_transfer(host, pool, in_host, in_dev)
        if staged is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                kv_transfer(blocks_view(staged), host, rows, out_host)
            staged.record_stream(side)
            idx.record_stream(side)

    def pop_swap_bytes(self) -> tuple[int, int]:
        out, self.bytes_swapped = tuple(self.bytes_swapped), [0, 0]
        return out

    # ---- execution -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """-> float32 logits [len(md.logits_indices), vocab]. With tensor parallelism rank 0 decides whether the
        forward replays a graph and tells the other ranks: every rank must run the same collectives (a graph's
        are on padded rows)."""
        if self.device.type == "cpu":
            cpu_kernels.poll()
        graphed = (self.graphs is not None and not md.prompt_logits and self.graphs.can_run(md)
                   and not self._timed_eagerly())
        if self.executor is not None:
            try:
                self.executor.launch(input_ids, md, self.timer.enabled, graphed)
                return self.forward(input_ids, md, graphed)
            except Exception as e:
                raise self.executor.explain(e) from e
        return self.forward(input_ids, md, graphed)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, md: AttentionMetadata, graphed: bool) -> torch.Tensor:
        """The forward as decided: a graph replay, or eager."""
        if graphed:
            return self.graphs.run(input_ids, md)
        hidden = self.model(input_ids, md)                       # [T, hidden]
        if md.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.mcfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[md.logits_indices])
