"""The q/k/v projection of a small-batch decode step with RoPE and the KV-cache store in its epilogue.

fused_linear's "rms_norm" prologue, but each program owns P rotation pairs of one head (rows j and
j + D/2), so it can rotate its outputs: q heads go to a [M, H, D] buffer for attention, k heads (rotated)
and v heads straight into the paged caches. Used in place of fused_linear + rope_and_store: one launch, and the
[M, (H + 2Hk) * D] intermediate is never written).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from engine.kernels import torch_ops
from engine.kernels.gemv import _activation
from engine.kernels.kv_store import kv_code


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr,
                     M, K, H, Hk, stride_xm, stride_wn, stride_qm, stride_cs,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, eps,
                     D: tl.constexpr, P: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = D // 2
    pid = tl.program_id(0)
    head = pid // (HALF // P)                                   # 0..H-1 q, H..H+Hk-1 k, then v
    j = (pid % (HALF // P)) * P + tl.arange(0, P)               # [P] first-half dims of this program's pairs
    rows1 = head * D + j                                        # weight rows of x1, and x2 = rows1 + HALF
    offs_m = tl.arange(0, BLOCK_M)
    mm = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w1_rows = w_ptr + rows1[:, None].to(tl.int64) * stride_wn
    w2_rows = w1_rows + HALF * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    km = (offs_k < K)[None, :]
    w1 = tl.load(w1_rows + offs_k[None, :], mask=km, other=0.0)   # weights: safe before the wait
    w2 = tl.load(w2_rows + offs_k[None, :], mask=km, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a, ss = _activation(x_rows, nw_ptr, offs_k, mm, K, 1, BLOCK_M)
    acc1 = tl.sum(a[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)   # [BM, P]
    acc2 = tl.sum(a[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        km = (offs_k < K)[None, :]
        w1 = tl.load(w1_rows + offs_k[None, :], mask=km, other=0.0)
        w2 = tl.load(w2_rows + offs_k[None, :], mask=km, other=0.0)
        a, sq = _activation(x_rows, nw_ptr, offs_k, mm, K, 1, BLOCK_M)
        acc1 += tl.sum(a[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)
        acc2 += tl.sum(a[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
        ss += sq
    rstd = tl.rsqrt(ss / K + eps)[:, None]
    acc1, acc2 = acc1 * rstd, acc2 * rstd
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + rows1).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + rows1 + HALF).to(tl.float32)[None, :]
    _rope_store(acc1, acc2, head, j, offs_m, mm, H, Hk, q_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr,
                stride_qm, stride_cs, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                D, BLOCK_SIZE)


@triton.jit
def _rope_store(x1, x2, head, j, offs_m, mm, H, Hk, q_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr,
                stride_qm, stride_cs, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Outputs x1, x2 [BM, P] (fp32) of rows j, j + D/2 of one head -> rounded to the projection's dtype,
    rotated (q, k), stored: q to [M, H, D], k and v into the paged caches at their slots (negative: skipped)."""
    HALF: tl.constexpr = D // 2
    dt = q_ptr.dtype.element_ty
    x1, x2 = x1.to(dt).to(tl.float32), x2.to(dt).to(tl.float32)        # the projection's output dtype, as unfused
    m2 = mm[:, None]
    if head < H + Hk:                                           # q or k: rotate
        pos = tl.load(pos_ptr + offs_m, mask=mm, other=0).to(tl.int64)[:, None]
        cos = tl.load(cs_ptr + pos * stride_cs + j[None, :], mask=m2, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + j[None, :], mask=m2, other=0.0).to(tl.float32)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if head < H:
        q_dst = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + head * D + j[None, :]   # not `dst`: an fp8
        tl.store(q_dst, x1.to(dt), mask=m2)                     # cache's pointer type differs from q's
        tl.store(q_dst + HALF, x2.to(dt), mask=m2)
    else:
        slot = tl.load(slot_ptr + offs_m, mask=mm, other=-1).to(tl.int64)
        ok = m2 & (slot >= 0)[:, None]                          # negative slot: padding, nothing stored
        slot = tl.maximum(slot, 0)
        blk, off = (slot // BLOCK_SIZE)[:, None], (slot % BLOCK_SIZE)[:, None]
        if head < H + Hk:
            dst = kc_ptr + blk * stride_kcb + off * stride_kcs + (head - H) * stride_kch + j[None, :]
        else:
            dst = vc_ptr + blk * stride_vcb + off * stride_vcs + (head - H - Hk) * stride_vch + j[None, :]
        tl.store(dst, kv_code(x1.to(dt), kc_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, kv_code(x2.to(dt), kc_ptr.dtype.element_ty), mask=ok)


# (N, K, D) -> (P rotation pairs per program, BLOCK_K, num_warps) at M = 1 on CUDA: benchmarks/sweep_gemv.py
# --qkv-rope's best on an H200; other shapes (and M > 1) take the rule below
# (Llama-3.1-8B, 6144 x 4096: the rule (2, 1024, 1) measured 16.0 us, 74% of copy BW, the sweep's best of 52)
QKV_ROPE_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (3072, 4096, 128): (1, 2048, 1),     # Llama-3.1-8B on one of two tensor-parallel ranks: 10.2 us [10.8]
}


def qkv_rope_config(M: int, N: int, K: int, D: int, device: torch.device) -> tuple[int, int, int]:
    half = D // 2
    cfg = None
    if M == 1 and device.type == "cuda":
        cfg = QKV_ROPE_CONFIGS.get((N, K, D))
    if cfg is None:
        P = 2 if half % 2 == 0 else 1
        bm = triton.next_power_of_2(M)
        cfg = (P, max(32, min(1024, triton.next_power_of_2(K), 8192 // (bm * 2 * P))), 1)
    return cfg


def fused_qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         norm_weight: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                         positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, pdl: bool = False,
                         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] residual stream -> q [M, H, D] = RoPE(RMSNorm(x) @ Wq.T); RoPE(k) and v into the caches
    [num_blocks, block_size, Hk, D] at flat slots (negative: skipped). weight [(H + 2Hk) * D, K], rows q, k, v.
    config: (P rotation pairs per program, BLOCK_K, num_warps) (a sweep), else qkv_rope_config's."""
    M, K = x.shape
    N = weight.shape[0]
    D = N // (num_heads + 2 * num_kv_heads)
    assert N == (num_heads + 2 * num_kv_heads) * D and D % 2 == 0 and weight.shape[1] == K
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and cos_sin.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and k_cache.dtype == v_cache.dtype
    q = torch.empty((M, num_heads, D), dtype=x.dtype, device=x.device)
    if M == 0:
        return q
    half = D // 2
    P, bk, warps = config or qkv_rope_config(M, N, K, D, x.device)
    assert half % P == 0, (P, D)
    bm = triton.next_power_of_2(M)
    _qkv_rope_kernel[((num_heads + 2 * num_kv_heads) * (half // P),)](
        x, weight, bias if bias is not None else weight, norm_weight, q, k_cache, v_cache, positions, cos_sin,
        slot_mapping, M, K, num_heads, num_kv_heads, x.stride(0), weight.stride(0), q.stride(0),
        cos_sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], eps,
        D=D, P=P, BLOCK_SIZE=k_cache.shape[1], HAS_BIAS=bias is not None, USE_PDL=pdl, BLOCK_M=bm,
        BLOCK_K=bk, num_warps=warps, num_stages=1, **({"launch_pdl": True} if pdl else {}))
    return q


def fused_qkv_rope_store_ref(*args, **kwargs):
    return torch_ops.fused_qkv_rope_store(*args, **kwargs)
