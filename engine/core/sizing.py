"""How big the engine is: the longest sequence it admits and the number of KV blocks in its pool."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.worker.model_runner import kv_bytes_per_block, kv_cache_dtype
from engine.models.config import ModelArchConfig


# (max_num_batched_tokens, max_num_seqs) where the config leaves them None: on a GPU a large token budget
# admits a burst of prompts in few steps (vLLM's server defaults are 8192 tokens / 1024 sequences on an
# H100 or H200), and max_num_seqs comes from the KV pool once it is sized (None here: `derive_max_num_seqs`);
# on a CPU a step costs about 2.5 ms per token of budget (SmolLM2, 2 cores), so a small budget keeps every
# step short: a newcomer (a person's chat turn) waits at most one short step, not the several seconds of a
# 2048-token prefill chunk.
DEVICE_DEFAULTS = {"cuda": (8192, None), "cpu": (256, 128)}
# int4 groups where the config leaves them None: the CPU's C++ int4 path takes groups of 32 or 64 (those that divide
# every K of a model: SmolLM2's hidden size, 576, is no multiple of 128) and 32 reproduces a GGUF's Q4 grid
INT4_GROUP_DEFAULTS = {"cuda": 128, "cpu": 32}
MAX_NUM_SEQS_CAP = 1024             # the most running requests a pool-derived max_num_seqs admits (vLLM's 1024)
KV_TOKENS_PER_SEQ = 512             # pool-derived max_num_seqs: one running request per this many KV tokens
SAMPLER_LOGITS_COPIES = 3           # a step's fp32 [rows, vocab] buffers in the sampler (probabilities, sorts)
GRAPH_AND_CONTEXT_BYTES = 1 << 30   # CUDA graphs' pools, kernels' workspaces, allocator slack


def with_device_defaults(cfg: EngineConfig, device: torch.device) -> EngineConfig:
    tokens, seqs = DEVICE_DEFAULTS.get(device.type, DEVICE_DEFAULTS["cpu"])
    changes = {}
    if cfg.scheduler_config.max_num_batched_tokens is None:
        changes["max_num_batched_tokens"] = tokens
    if cfg.scheduler_config.max_num_seqs is None and seqs is not None:
        changes["max_num_seqs"] = seqs
    if cfg.model_config.int4_group_size is None:
        changes["int4_group_size"] = INT4_GROUP_DEFAULTS.get(device.type, INT4_GROUP_DEFAULTS["cpu"])
    return cfg.replace(**changes) if changes else cfg


def derive_max_num_seqs(num_blocks: int, block_size: int) -> int:
    """max_num_seqs from the KV pool (a config that leaves it None on a GPU): one running request per
    KV_TOKENS_PER_SEQ tokens the pool holds, at most MAX_NUM_SEQS_CAP, a multiple of 16 above 16 (a captured
    CUDA-graph size). Requests longer than that still run: the scheduler admits by free blocks and preempts
    when decodes run out of them, so this bounds the batch, not a request."""
    n = min(MAX_NUM_SEQS_CAP, max(1, (num_blocks - 1) * block_size // KV_TOKENS_PER_SEQ))
    return n if n <= 16 else n // 16 * 16


def derive_max_model_len(cfg: EngineConfig, mcfg: ModelArchConfig) -> int:
    """The longest sequence the engine admits: max_model_len, or the model's limit (capped at 8192, and at the
    sliding window of a model that has one: attention here is full-context, which equals sliding-window
    attention only while no sequence is longer than the window)."""
    window = mcfg.sliding_window
    if window is not None and cfg.model_config.max_model_len is not None and cfg.model_config.max_model_len > window:
        raise ValueError(f"EngineConfig.max_model_len: {cfg.model_config.max_model_len} exceeds the model's "
                         f"sliding_window ({window}); sliding-window attention is not implemented, so sequences must fit "
                         f"in the window (set max_model_len <= {window})")
    if cfg.model_config.max_model_len is not None:
        if cfg.model_config.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len: {cfg.model_config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({mcfg.max_position_embeddings})")
        n = cfg.model_config.max_model_len
    else:
        n = min(mcfg.max_position_embeddings, 8192, window or 8192)
    if not cfg.scheduler_config.enable_chunked_prefill and cfg.scheduler_config.max_num_batched_tokens < n:
        if cfg.model_config.max_model_len is not None:
            raise ValueError(f"EngineConfig.max_num_batched_tokens: {cfg.scheduler_config.max_num_batched_tokens} < "
                             f"max_model_len ({n}) with chunked prefill off: a long prompt could never run")
        n = cfg.scheduler_config.max_num_batched_tokens
    return n


def derive_num_blocks(cfg: EngineConfig, mcfg: ModelArchConfig, device: torch.device, dtype: torch.dtype,
                      weight_bytes: int = 0, step_bytes: int | None = None, extra_block_bytes: int = 0) -> int:
    """KV blocks in the pool: num_kv_blocks, or what the memory budget holds, in bytes of the pool's element type
    (an fp8 pool holds twice the blocks of a bf16 one). On a GPU, as vLLM sizes it: gpu_memory_utilization of the
    GPU's memory, less this engine's weights (`weight_bytes`, this rank's shard), a full step's activations
    (`step_bytes`, measured by `profile_step_bytes`; None: an upper estimate), the sampler's buffers and
    GRAPH_AND_CONTEXT_BYTES; never more than the memory free now allows. On a CPU: cpu_kv_cache_gib.
    extra_block_bytes: what each block costs elsewhere (a draft model's pool holds the same blocks)."""
    if cfg.cache_config.num_kv_blocks is not None:
        return cfg.cache_config.num_kv_blocks
    per_block = kv_bytes_per_block(mcfg, cfg.cache_config.block_size, kv_cache_dtype(cfg, dtype)) + extra_block_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        tokens = cfg.scheduler_config.max_num_batched_tokens
        if step_bytes is None:
            step_bytes = tokens * (6 * mcfg.hidden_size + 4 * mcfg.intermediate_size) * 4
        rows = min(tokens, cfg.scheduler_config.max_num_seqs or MAX_NUM_SEQS_CAP)
        reserve = step_bytes + rows * mcfg.vocab_size * 4 * SAMPLER_LOGITS_COPIES + GRAPH_AND_CONTEXT_BYTES
        budget = min(int(total * cfg.cache_config.gpu_memory_utilization) - weight_bytes, free) - reserve
    else:
        budget = int(cfg.cache_config.cpu_kv_cache_gib * (1 << 30))
    n = budget // per_block
    if n < 2:
        raise ValueError(f"EngineConfig: the KV memory budget ({budget / 2**20:.0f} MiB) holds fewer than "
                         f"2 blocks of {per_block / 2**20:.2f} MiB")
    return int(n)


def draft_model_bytes(cfg: EngineConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes, KV bytes per block) of the draft model (speculative_method="draft"), from its config, before
    it is loaded: it is built after the target's pool is sized, beside it. (0, 0) without one."""
    if cfg.speculative_config.speculative_method != "draft":
        return 0, 0
    from engine.models.loader import resolve
    from engine.spec.model_drafter import parse_draft_model
    d = ModelArchConfig.from_hf(resolve(parse_draft_model(cfg.speculative_config.draft_model, 0)[0])[0])
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    params = d.vocab_size * d.hidden_size * (1 if d.tie_word_embeddings else 2) + d.num_layers * (
        d.hidden_size * (2 * q + 2 * kv) + 3 * d.hidden_size * d.intermediate_size)
    elem = torch.tensor([], dtype=dtype).element_size()
    return params * elem, kv_bytes_per_block(d, cfg.cache_config.block_size, kv_cache_dtype(cfg, dtype))


def resident_bytes(model) -> int:
    """Bytes the model holds on its device: parameters and buffers (this rank's shard)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def profile_step_bytes(model, mcfg: ModelArchConfig, config: EngineConfig, device: torch.device,
                       dtype: torch.dtype, max_model_len: int) -> int | None:
    """Peak bytes a full step allocates on the GPU beyond what is held before it: an eager forward of
    max_num_batched_tokens tokens, in sequences of at most max_model_len, with logits for the most rows a step
    samples, through a one-block pool (every slot and every block-table entry is block 0). Every rank of a
    tensor-parallel engine runs it at the same time: it makes the forward's collectives. None off CUDA (a CPU
    pool is sized by cpu_kv_cache_gib)."""
    if device.type != "cuda":
        return None
    from engine.kernels.metadata import AttentionMetadata
    from engine.worker.model_runner import ModelRunner
    tokens = config.scheduler_config.max_num_batched_tokens
    rows = min(tokens, config.scheduler_config.max_num_seqs or MAX_NUM_SEQS_CAP)
    bs = config.cache_config.block_size
    lens = [min(max_model_len, tokens - i) for i in range(0, tokens, max_model_len)]
    runner = ModelRunner(model, mcfg, config, device, dtype, 1, max_model_len)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    md = AttentionMetadata(
        positions=pos, slot_mapping=pos % bs,
        cu_seqlens_q=torch.tensor([0] + lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(lens), -(-max(lens) // bs), dtype=torch.int32, device=device),
        logits_indices=torch.arange(tokens - rows, tokens, device=device), q_lens=lens, seq_lens_cpu=lens,
        max_seqlen_q=max(lens), max_seqlen_k=max(lens), block_size=bs)
    ids = torch.ones(tokens, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    runner.forward(ids, md, False)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held
    for layer in model.model.layers:            # the real pool replaces the one-block one
        layer.self_attn.k_cache = layer.self_attn.v_cache = None
    del runner, md, ids, pos
    torch.cuda.empty_cache()
    return int(peak)
