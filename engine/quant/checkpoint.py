"""Pre-quantized Hugging Face checkpoints: which format a config.json's `quantization_config` describes.

Supported layouts (the ones published for Qwen3 / Llama models):
- FP8 block-wise: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}; tensors `*.weight` float8_e4m3fn and `*.weight_scale_inv` [N/128, K/128].
- compressed-tensors w8a8 int8: {"quant_method": "compressed-tensors", "config_groups": {...: {"weights":
  {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel"}, ...}}}; tensors `*.weight` int8
  and `*.weight_scale` [N, 1] (activations are quantized per token at run time by the producers' engines;
  here they stay in the model dtype: weight-only).
"""
from __future__ import annotations

import torch


def checkpoint_format(hf_cfg: dict) -> str | None:
    """-> "fp8" | "int8" for a supported pre-quantized checkpoint, None for a float one; raises otherwise."""
    qc = hf_cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if list(block or []) != [128, 128] or qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"model: quantization_config fp8 with weight_block_size {block!r} and fmt "
                             f"{qc.get('fmt')!r} is not supported (block-wise [128, 128] e4m3 only)")
        return "fp8"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        for g in groups.values():
            w = g.get("weights") or {}
            if (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("symmetric", True)) != \
                    (8, "int", "channel", True):
                raise ValueError(f"model: compressed-tensors weights {w!r} are not supported "
                                 "(int8 symmetric per-channel, the w8a8 layout, only)")
        if not groups:
            raise ValueError("model: compressed-tensors quantization_config has no config_groups")
        return "int8"
    raise ValueError(f"model: quantization_config quant_method {method!r} is not supported "
                     "(fp8 block-wise [128, 128]; compressed-tensors int8 per-channel)")


def skip_tensor(name: str, tensor: torch.Tensor) -> bool:
    """Checkpoint tensors that carry nothing a weight-only layer needs: static input scales, and zero points
    that must be zero (symmetric)."""
    if name.endswith(".input_scale"):
        return True
    if name.endswith(".weight_zero_point"):
        if bool(tensor.ne(0).any()):
            raise ValueError(f"model: {name} is non-zero: asymmetric int8 weights are not supported")
        return True
    return False
