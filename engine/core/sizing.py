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
MAX_NUM_SEQS_CAP = 1024             # the most running requests a pool-derived max_num_seqs admits (vLLM's 1024)
KV_TOKENS_PER_SEQ = 512             # pool-derived max_num_seqs: one running request per this many KV tokens


def with_device_defaults(cfg: EngineConfig, device: torch.device) -> EngineConfig:
    tokens, seqs = DEVICE_DEFAULTS.get(device.type, DEVICE_DEFAULTS["cpu"])
    changes = {}
    if cfg.scheduler_config.max_num_batched_tokens is None:
        changes["max_num_batched_tokens"] = tokens
    if cfg.scheduler_config.max_num_seqs is None and seqs is not None:
        changes["max_num_seqs"] = seqs
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


def derive_num_blocks(cfg: EngineConfig, mcfg: ModelArchConfig, device: torch.device, dtype: torch.dtype) -> int:
    """KV blocks in the pool: num_kv_blocks, or what the memory budget holds (free GPU memory, or the CPU size),
    in bytes of the pool's element type (an fp8 pool holds twice the blocks of a bf16 one)."""
    if cfg.cache_config.num_kv_blocks is not None:
        return cfg.cache_config.num_kv_blocks
    per_block = kv_bytes_per_block(mcfg, cfg.cache_config.block_size, kv_cache_dtype(cfg, dtype))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        reserve = cfg.scheduler_config.max_num_batched_tokens \
            * (6 * mcfg.hidden_size + 4 * mcfg.intermediate_size) * 4 \
            + (cfg.scheduler_config.max_num_seqs or MAX_NUM_SEQS_CAP) * mcfg.vocab_size * 4 * 3 + (1 << 30)
        budget = int(free * cfg.cache_config.gpu_memory_utilization) - reserve
    else:
        budget = int(cfg.cache_config.cpu_kv_cache_gib * (1 << 30))
    n = budget // per_block
    if n < 2:
        raise ValueError(f"EngineConfig: the KV memory budget ({budget / 2**20:.0f} MiB) holds fewer than "
                         f"2 blocks of {per_block / 2**20:.2f} MiB")
    return int(n)
