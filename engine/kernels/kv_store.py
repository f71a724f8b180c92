"""Scatter this step's K/V [T, Hk, D] into the paged caches [num_blocks, block_size, Hk, D] by slot.

An fp8 cache (EngineConfig.kv_cache_dtype="fp8", torch.float8_e4m3fn) holds e4m3 codes of K/V at scale 1.0:
`kv_code` saturates at +-448 and rounds to nearest even before the cast, the same values as torch's
conversion (torch_ops.kv_encode), so the store kernels here, in rope.py and qkv_rope.py agree with the torch
path bit for bit (the Triton interpreter's own fp32 -> fp8 cast drops the carry of a mantissa round-up).
The attention kernels upcast the codes in registers (attention_core.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import torch_ops


FP8_MAX = 448.0


@triton.jit
def kv_code(x, dt: tl.constexpr):
    """x (any float) -> the cache's element type dt; fp8 e4m3: saturated, rounded to nearest even."""
    if dt == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)                  # keep 3 mantissa bits, carry into the exponent
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        normal = bits.to(tl.float32, bitcast=True)
        sub = (tl.abs(x) + 24576.0) - 24576.0                # below 2^-6: multiples of 2^-9 (subnormals)
        # x's sign by its bit, -0.0 included (some Triton versions lower -y to 0 - y, which makes -0.0 +0.0)
        sub = (sub.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x.to(dt)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     Hk, D, BLOCK_SIZE: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    nh = tl.where(slot >= 0, Hk, 0)                          # negative slot: padding token, skip
    slot = tl.maximum(slot, 0)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, BH)[:, None]
    d = tl.arange(0, BD)[None, :]
    mask = (h < nh) & (d < D)                                # [BH, BD]
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
             kv_code(k, kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
             kv_code(v, vc_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hk, D] (any strides) into caches [num_blocks, block_size, Hk, D] (D contiguous) at
    flat slots block * block_size + offset; a negative slot is skipped. An fp8 cache gets e4m3 codes."""
    T, Hk, D = k.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if T == 0:
        return
    bh, bd = triton.next_power_of_2(Hk), triton.next_power_of_2(D)
    warps = min(8, max(1, bh * bd * k.element_size() // 512))
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, *k.stride(), *v.stride(),
                           *k_cache.stride()[:3], *v_cache.stride()[:3], Hk, D,
                           BLOCK_SIZE=k_cache.shape[1], BH=bh, BD=bd, num_warps=warps)


def store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping):
    torch_ops.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
