"""Triton backend: the same five functions as torch_ops (see there for the contract), plus the decode entry."""
from .activation import silu_and_mul
from .kv_store import store_kvcache
from .paged_attention import decode_num_splits, paged_attention, paged_attention_decode
from .rmsnorm import rms_norm
from .rope import apply_rope

__all__ = ["rms_norm", "silu_and_mul", "apply_rope", "store_kvcache", "paged_attention",
           "paged_attention_decode", "decode_num_splits"]
