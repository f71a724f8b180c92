"""Start an engine's tensor-parallel ranks: check the layout first, then spawn the workers and join the group."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.models.config import ModelArchConfig
from engine.distributed.executor import TPExecutor
from engine.distributed.sharding import shard_layout


def parallel_layout(tp: int, device: torch.device) -> str:
    """How the engine is laid out, for the status line and /metrics: 'TP=2 · nccl · cuda:0-1'."""
    if tp == 1:
        return f"single device · {device}"
    if device.type == "cuda":
        base = device.index or 0
        return f"TP={tp} · nccl · cuda:{base}-{base + tp - 1}"
    return f"TP={tp} · gloo · cpu"


def start_workers(config: EngineConfig, hf_cfg: dict, weights: Path | None, device: torch.device,
                  dtype: torch.dtype, kernels: str, max_pos: int, gemv_max_tokens: int,
                  gemv_pdl: bool) -> TPExecutor:
    tp = config.parallel_config.tensor_parallel_size
    mcfg = ModelArchConfig.from_hf(hf_cfg)
    for rank in range(tp):
        shard_layout(mcfg, tp, rank)                # a clear error before any process starts
    if device.type == "cuda":
        base = device.index or 0
        if base + tp > torch.cuda.device_count():
            raise ValueError(f"EngineConfig.tensor_parallel_size: {tp} ranks from {device} need "
                             f"{base + tp} CUDA devices, this machine has {torch.cuda.device_count()}")
    args = dict(hf_config=hf_cfg, weights=None if weights is None else str(weights), device=str(device),
                dtype=str(dtype).replace("torch.", ""), kernels=kernels, max_pos=max_pos,
                config=config.to_dict(), gemv_max_tokens=gemv_max_tokens, gemv_pdl=gemv_pdl,
                threads=max(1, torch.get_num_threads() // tp))
    return TPExecutor(tp, device, args)
