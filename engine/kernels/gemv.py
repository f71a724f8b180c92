"""Small-batch linear layers (a decode step of a few tokens) as one pass over the weight, with fusions.

At batch 1 a decode step is a chain of GEMVs separated by tiny kernels (norms, activation, residual adds),
each a launch plus a ramp. `fused_linear` reads the weight once and folds those neighbours in:
- prologue "rms_norm": the input row is the residual stream; RMSNorm(x) * norm_weight is applied on the fly:
  (x * norm_weight) . w accumulates beside sum(x^2), and 1/rms scales the result (one pass; the normalised
  row is not rounded to the input dtype as the unfused norm's output is);
- prologue "silu_mul": the input is [gate | up] and silu(gate) * up is formed on the fly (the down projection);
- epilogue residual: out = residual + x @ W.T, rounded like torch's bf16 add (the o and down projections).
The activation is rounded to the input dtype like the unfused kernel's output.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import torch_ops

PROLOGUES = {None: 0, "rms_norm": 1, "silu_mul": 2}


@triton.jit
def _activation(x_rows, nw_ptr, offs_k, mm, K, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr):
    """One [BM, BK] tile of prologue(x) in fp32, and its rows' sums of squares (rms_norm; else zeros)."""
    km = offs_k < K
    xmask = mm[:, None] & km[None, :]
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 2:
        g = tl.load(x_rows + offs_k[None, :], mask=xmask, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + offs_k[None, :], mask=xmask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(x_rows.dtype.element_ty).to(tl.float32)
    else:
        a = tl.load(x_rows + offs_k[None, :], mask=xmask, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            sq = tl.sum(a * a, axis=1)
            a = a * tl.load(nw_ptr + offs_k, mask=km, other=0.0).to(tl.float32)[None, :]
    return a, sq


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K,
                 stride_xm, stride_wn, stride_rm, stride_om, eps,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm                  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1]
    offs_k = tl.arange(0, BLOCK_K)
    # the weights never come from the previous kernel: under PDL the first tile is fetched while it finishes
    w = tl.load(w_rows + offs_k[None, :], mask=nm[:, None] & (offs_k < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                             # the previous kernel's outputs are now visible
        tl.extra.cuda.gdc_launch_dependents()                # the next kernel may start prefetching its weights
    a, ss = _activation(x_rows, nw_ptr, offs_k, mm, K, PROLOGUE, BLOCK_M)
    acc = tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)        # [BM, BN, BK] -> [BM, BN]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=nm[:, None] & (offs_k < K)[None, :], other=0.0)
        a, sq = _activation(x_rows, nw_ptr, offs_k, mm, K, PROLOGUE, BLOCK_M)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        ss += sq
    _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE, HAS_BIAS, HAS_RES)


@triton.jit
def _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """acc [BM, BN] fp32 -> out: the rms_norm prologue's 1/rms (applied last), bias, rounding, residual add."""
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    omask = mm[:, None] & nm[None, :]
    if HAS_RES:
        r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=omask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y, mask=omask)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, compiled Triton (not the interpreter)."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def gemv_config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [M <= 16, K] x [N, K].T product. At M = 1 these are the
    best of benchmarks/sweep_gemv.py on an H200 for Llama-3.2-1B's projections (many one-warp programs of 4
    weight rows); BLOCK_K shrinks as M grows (registers)."""
    if K >= 4096:
        bn, bk, warps = 4, 2048, 8          # down: 14.2 us for 33.6 MB
    elif N <= K:
        bn, bk, warps = 4, 2048, 1          # o: 5.0 us for 8.4 MB
    else:
        bn, bk, warps = 4, 1024, 1          # qkv 6.7 us / 12.6 MB, gate_up 20.1 us / 67 MB
    bm = triton.next_power_of_2(M)
    return bn, max(32, min(bk, triton.next_power_of_2(K), 8192 // (bm * bn))), warps, 1


def check_gemv_args(x: torch.Tensor, N: int, K: int, prologue: str | None, norm_weight, residual) -> None:
    """The input contract fused_linear and the quantized GEMVs share: x [M, K] ([M, 2K] for silu_mul) with
    contiguous rows, a norm weight for rms_norm, a residual [M, N] with contiguous rows."""
    assert prologue in PROLOGUES and x.stride(-1) == 1
    assert x.shape[-1] == (2 * K if prologue == "silu_mul" else K), (x.shape, (N, K), prologue)
    assert prologue != "rms_norm" or norm_weight is not None
    if residual is not None:
        assert residual.shape == (x.shape[0], N) and residual.stride(-1) == 1


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 prologue: str | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 residual: torch.Tensor | None = None, pdl: bool = False,
                 config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] for silu_mul) -> [M, N] = prologue(x) @ weight.T (+ bias) (+ residual).
    weight [N, K] with contiguous rows; M is small (a decode step). pdl: launch as a programmatic dependent
    of the previous kernel (see pdl_supported), overlapping its tail with this kernel's first weight fetch."""
    M = x.shape[0]
    N, K = weight.shape
    assert weight.stride(-1) == 1
    check_gemv_args(x, N, K, prologue, norm_weight, residual)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bn, bk, warps, stages = config or gemv_config(M, N, K)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out, out, M, N, K,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        PROLOGUE=PROLOGUES[prologue], HAS_BIAS=bias is not None, HAS_RES=residual is not None, USE_PDL=pdl,
        BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}))
    return out


def fused_linear_ref(x, weight, bias=None, *, prologue=None, norm_weight=None, eps=1e-6, residual=None, pdl=False):
    return torch_ops.fused_linear(x, weight, bias, prologue=prologue, norm_weight=norm_weight, eps=eps,
                                  residual=residual)
