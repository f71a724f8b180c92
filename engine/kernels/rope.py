"""Rotary embedding (neox / HF rotate-halves), in place on q and k, one program per token for all heads."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import torch_ops
from engine.kernels.kv_store import kv_code


@triton.jit
def _rotate(ptr, stride_h, stride_d, nheads, cos, sin, offs_x, HALF: tl.constexpr, BH: tl.constexpr):
    # ptr: this token's row; cos/sin [1, BHALF]; rotates [nheads, D] in place
    offs_h = tl.arange(0, BH)
    mask = (offs_h[:, None] < nheads) & (offs_x[None, :] < HALF)
    p1 = ptr + offs_h[:, None] * stride_h + offs_x[None, :] * stride_d     # [BH, BHALF]
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(cs_ptr, pos_ptr, t, stride_cs, offs_x, xm, HALF: tl.constexpr):
    # token t's cos and sin rows, [1, BHALF] each, from the cat(cos, sin) table
    row = cs_ptr + tl.load(pos_ptr + t).to(tl.int64) * stride_cs
    cos = tl.load(row + offs_x, mask=xm, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + offs_x, mask=xm, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, stride_qt, stride_qh, stride_qd,
                 stride_kt, stride_kh, stride_kd, stride_cs, H, Hk,
                 HALF: tl.constexpr, BHALF: tl.constexpr, BH_Q: tl.constexpr, BH_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_x = tl.arange(0, BHALF)
    xm = offs_x < HALF
    cos, sin = _cos_sin(cs_ptr, pos_ptr, t, stride_cs, offs_x, xm, HALF)
    _rotate(q_ptr + t * stride_qt, stride_qh, stride_qd, H, cos, sin, offs_x, HALF, BH_Q)
    _rotate(k_ptr + t * stride_kt, stride_kh, stride_kd, Hk, cos, sin, offs_x, HALF, BH_K)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr,
                       stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                       stride_vt, stride_vh, stride_vd, stride_cs,
                       stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, H, Hk,
                       HALF: tl.constexpr, BHALF: tl.constexpr, BH_Q: tl.constexpr, BH_K: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr):
    # one token: q rotated in place; k rotated and, with v, written straight into the paged caches
    if USE_PDL:                                              # launched early: wait for q/k/v to be written
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_x = tl.arange(0, BHALF)
    xm = offs_x < HALF
    cos, sin = _cos_sin(cs_ptr, pos_ptr, t, stride_cs, offs_x, xm, HALF)
    _rotate(q_ptr + t * stride_qt, stride_qh, stride_qd, H, cos, sin, offs_x, HALF, BH_Q)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    nh = tl.where(slot >= 0, Hk, 0)                          # negative slot: padding token, nothing to store
    slot = tl.maximum(slot, 0)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, BH_K)[:, None]
    mask = (h < nh) & xm[None, :]                            # [BH_K, BHALF]
    kp = k_ptr + t * stride_kt + h * stride_kh + offs_x[None, :] * stride_kd
    k1 = tl.load(kp, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(kp + HALF * stride_kd, mask=mask, other=0.0).to(tl.float32)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + offs_x[None, :]
    kdt = k_ptr.dtype.element_ty                             # rounded to k's dtype first, as the unfused store
    tl.store(kc, kv_code((k1 * cos - k2 * sin).to(kdt), kc_ptr.dtype.element_ty), mask=mask)
    tl.store(kc + HALF, kv_code((k2 * cos + k1 * sin).to(kdt), kc_ptr.dtype.element_ty), mask=mask)
    vp = v_ptr + t * stride_vt + h * stride_vh + offs_x[None, :] * stride_vd
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + offs_x[None, :]
    tl.store(vc, kv_code(tl.load(vp, mask=mask), vc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + HALF, kv_code(tl.load(vp + HALF * stride_vd, mask=mask), vc_ptr.dtype.element_ty), mask=mask)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, pdl: bool = False) -> None:
    """RoPE on q in place; RoPE(k) and v into caches [num_blocks, block_size, Hk, D] at flat slots (negative:
    skipped; an fp8 cache gets e4m3 codes). k itself is left unrotated. One launch instead of apply_rope + store_kvcache. pdl: launch as a
    programmatic dependent of the previous kernel (Hopper+, compiled Triton only)."""
    T, H, D = q.shape
    Hk = k.shape[1]
    assert cos_sin.stride(-1) == 1 and D % 2 == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.dtype in (v.dtype, torch.float8_e4m3fn), "the fused store casts v only to fp8 codes"
    if T == 0:
        return
    half = D // 2
    bh_q, bh_k, bhalf = triton.next_power_of_2(H), triton.next_power_of_2(Hk), triton.next_power_of_2(half)
    warps = min(8, max(1, bh_q * bhalf // 256))
    _rope_store_kernel[(T,)](q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                             *q.stride(), *k.stride(), *v.stride(), cos_sin.stride(0),
                             *k_cache.stride()[:3], *v_cache.stride()[:3], H, Hk,
                             HALF=half, BHALF=bhalf, BH_Q=bh_q, BH_K=bh_k, BLOCK_SIZE=k_cache.shape[1],
                             USE_PDL=pdl, num_warps=warps, **({"launch_pdl": True} if pdl else {}))


def rope_and_store_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, pdl=False):
    torch_ops.rope_and_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """In place. q [T, H, D], k [T, Hk, D] (any strides, e.g. views of a fused qkv), positions [T],
    cos_sin [max_pos, D] = cat(cos, sin) (last dim contiguous)."""
    T, H, D = q.shape
    Hk = k.shape[1]
    assert cos_sin.stride(-1) == 1 and D % 2 == 0
    if T == 0:
        return
    half = D // 2
    bh_q, bh_k = triton.next_power_of_2(H), triton.next_power_of_2(Hk)
    bhalf = triton.next_power_of_2(half)
    warps = min(8, max(1, bh_q * bhalf // 256))
    _rope_kernel[(T,)](q, k, positions, cos_sin, *q.stride(), *k.stride(), cos_sin.stride(0), H, Hk,
                       HALF=half, BHALF=bhalf, BH_Q=bh_q, BH_K=bh_k, num_warps=warps)


def apply_rope_ref(q, k, positions, cos_sin):
    torch_ops.apply_rope(q, k, positions, cos_sin)
