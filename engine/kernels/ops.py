"""One dispatch layer between the model and its kernels: `get_ops("torch" | "triton")`.

Both backends expose the same functions with the same signatures (see torch_ops.py for the contract):
rms_norm, head_rms_norm_ (Qwen3's q/k norm, in place), silu_and_mul, apply_rope, store_kvcache, rope_and_store,
paged_attention, fused_linear (a small-batch linear with RMSNorm / SiLU-mul prologue and residual epilogue),
fused_qkv_rope_store (the small-batch q/k/v linear with RoPE and the KV store in its epilogue).
"""
from __future__ import annotations

from types import SimpleNamespace

from engine.kernels import torch_ops

_NAMES = ("rms_norm", "head_rms_norm_", "silu_and_mul", "apply_rope", "store_kvcache", "rope_and_store",
          "paged_attention", "fused_linear", "fused_qkv_rope_store")


def pdl_supported(device) -> bool:
    """Whether the Triton linears can launch as programmatic dependents here (Hopper+, compiled Triton)."""
    if device.type != "cuda":
        return False
    from engine.kernels.gemv import pdl_supported as supported
    return supported(device)


def get_ops(backend: str) -> SimpleNamespace:
    if backend == "torch":
        return SimpleNamespace(name=backend, **{n: getattr(torch_ops, n) for n in _NAMES})
    elif backend == "triton":
        from engine.kernels import triton_ops as mod  # imported lazily: triton is optional on CPU
    else:
        raise ValueError(f"kernels: unknown backend {backend!r} (expected 'torch' or 'triton')")
    return SimpleNamespace(name=backend, **{n: getattr(mod, n) for n in _NAMES})
