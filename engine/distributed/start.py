"""Start an engine's tensor-parallel ranks: check the layout first, then start (or, under torchrun, meet) the
workers and join the group."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.distributed.executor import TPExecutor
from engine.distributed.launch import EnvLaunch
from engine.distributed.sharding import shard_layout
from engine.models.config import ModelArchConfig


def parallel_layout(tp: int, device: torch.device, launch: EnvLaunch | None = None, one_shot: bool = False) -> str:
    """How the engine is laid out, for the status line and /metrics: 'TP=2 · nccl + one-shot · cuda:0-1'
    (one_shot: small all-reduces take the custom all-reduce)."""
    if tp == 1:
        return f"single device · {device}"
    backend = ("nccl" + (" + one-shot" if one_shot else "")) if device.type == "cuda" else "gloo"
    if launch is not None:
        return f"TP={tp} · {backend} · launched (torchrun)"
    if device.type == "cuda":
        base = device.index or 0
        return f"TP={tp} · {backend} · cuda:{base}-{base + tp - 1}"
    return f"TP={tp} · {backend} · cpu"


def start_workers(config: EngineConfig, hf_cfg: dict, weights: Path | None, device: torch.device,
                  launch: EnvLaunch | None, **model_args) -> TPExecutor:
    """model_args: what every rank builds its shard with (dtype, kernels, max_pos, GEMV and quantized-kernel
    options), plain values."""
    tp = config.parallel_config.tensor_parallel_size
    mcfg = ModelArchConfig.from_hf(hf_cfg)
    for rank in range(tp):
        shard_layout(mcfg, tp, rank)                # a clear error before any process starts
    if device.type == "cuda" and launch is None:
        base = device.index or 0
        if base + tp > torch.cuda.device_count():
            raise ValueError(f"EngineConfig.tensor_parallel_size: {tp} ranks from {device} need "
                             f"{base + tp} CUDA devices, this machine has {torch.cuda.device_count()}")
    args = dict(hf_config=hf_cfg, weights=None if weights is None else str(weights), config=config.to_dict(),
                threads=max(1, torch.get_num_threads() // tp), **model_args)
    return TPExecutor(tp, device, args, launch)
