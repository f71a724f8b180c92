"""Triton backend: the same functions as torch_ops (see there for the contract), plus the decode entry."""
from engine.kernels.activation import silu_and_mul
from engine.kernels.gemv import fused_linear
from engine.kernels.kv_store import store_kvcache
from engine.kernels.decode_attention import decode_num_splits, paged_attention_decode
from engine.kernels.paged_attention import paged_attention
from engine.kernels.qkv_rope import fused_qkv_rope_store
from engine.kernels.rmsnorm import head_rms_norm_, rms_norm
from engine.kernels.rope import apply_rope, rope_and_store

__all__ = ["rms_norm", "head_rms_norm_", "silu_and_mul", "apply_rope", "store_kvcache", "rope_and_store",
           "paged_attention",
           "fused_linear", "fused_qkv_rope_store", "paged_attention_decode", "decode_num_splits"]
