"""Small-batch linear layers (a decode step of a few tokens) as one pass over the weight, with fusions.

At batch 1 a decode step is a chain of GEMVs separated by tiny kernels (norms, activation, residual adds),
each a launch plus a ramp. `fused_linear` reads the weight once and folds those neighbours in:
- prologue "rms_norm": the input row is the residual stream; RMSNorm(x) * norm_weight is applied on the fly:
  (x * norm_weight) . w accumulates beside sum(x^2), and 1/rms scales the result (one pass; the normalised
  row is not rounded to the input dtype as the unfused norm's output is);
- prologue "silu_mul": the input is [gate | up] and silu(gate) * up is formed on the fly (the down projection);
- epilogue residual: out = residual + x @ W.T, rounded like torch's bf16 add (the o and down projections).
The activation is rounded to the input dtype like the unfused kernel's output.

Two kernels (EngineConfig.gemv_variant; resolve_config picks the launch): tiled (a program owns BLOCK_N rows and
walks K) and persistent (a few programs per SM; each forms the prologue over the whole K once and streams row
tiles). GEMV_CONFIGS holds the swept winner per (N, K) at M = 1.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.kernels import torch_ops

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
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr = 0):
    """The tiled variant: a program owns BLOCK_N rows and walks K in BLOCK_K tiles (PRE 1: the next tile's load
    is issued before this one is multiplied, so two tiles are in flight)."""
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
    if PRE:
        offs_k2 = BLOCK_K + tl.arange(0, BLOCK_K)
        w2 = tl.load(w_rows + offs_k2[None, :], mask=nm[:, None] & (offs_k2 < K)[None, :], other=0.0)
    acc = tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)        # [BM, BN, BK] -> [BM, BN]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if PRE:
            w = w2
            offs_k2 = offs_k + BLOCK_K
            w2 = tl.load(w_rows + offs_k2[None, :], mask=nm[:, None] & (offs_k2 < K)[None, :], other=0.0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=nm[:, None] & (offs_k < K)[None, :], other=0.0)
        a, sq = _activation(x_rows, nw_ptr, offs_k, mm, K, PROLOGUE, BLOCK_M)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        ss += sq
    _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, nm, K, stride_rm, stride_om, eps,
              PROLOGUE, HAS_BIAS, HAS_RES)


@triton.jit
def _gemv_persistent_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, out_ptr, M, N, K,
                            stride_xm, stride_wn, stride_rm, stride_om, eps,
                            PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                            USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, DEPTH: tl.constexpr):
    """The persistent variant: a grid of a few programs per SM; each forms prologue(x) over the whole K once
    (BLOCK_K >= K: the row's norm / SiLU-mul is computed once per program, not once per BLOCK_N rows) and keeps
    it in registers while it streams row tiles pid, pid + grid, ... of the weight, DEPTH (1 or 2) tiles ahead
    of the one it multiplies, so every SM keeps whole rows of weight bytes in flight."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    mm = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    km = (offs_k < K)[None, :]
    rows = tl.arange(0, BLOCK_N)
    n_tiles = tl.cdiv(N, BLOCK_N)
    # tiles past the end load nothing (masked): the prefetch never branches
    n1 = pid * BLOCK_N + rows
    w1 = tl.load(w_ptr + n1[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=(n1 < N)[:, None] & km,
                 other=0.0)
    if DEPTH == 2:
        n2 = n1 + step * BLOCK_N
        w2 = tl.load(w_ptr + n2[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=(n2 < N)[:, None] & km,
                     other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    a, ss = _activation(x_rows, nw_ptr, offs_k, mm, K, PROLOGUE, BLOCK_M)      # [BM, BK] fp32, once
    for t in range(pid, n_tiles, step):
        offs_n = t * BLOCK_N + rows
        nn = offs_n + DEPTH * step * BLOCK_N                                    # the tile DEPTH rounds ahead
        w_next = tl.load(w_ptr + nn[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                         mask=(nn < N)[:, None] & km, other=0.0)
        acc = tl.sum(a[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)    # [BM, BN]
        _epilogue(acc, ss, b_ptr, r_ptr, out_ptr, offs_m, offs_n, mm, offs_n < N, K, stride_rm, stride_om, eps,
                  PROLOGUE, HAS_BIAS, HAS_RES)
        if DEPTH == 2:
            w1 = w2
            w2 = w_next
        else:
            w1 = w_next


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
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the tiled variant for an [M <= 16, K] x [N, K].T product. At
    M = 1 these are the best of benchmarks/sweep_gemv.py on an H200 for Llama-3.2-1B's projections (many one-warp
    programs of 4 weight rows); BLOCK_K shrinks as M grows (registers). (gemv_variant="tiled": the previous
    default, kept as the ablation of the tuned table below.)"""
    if K >= 4096:
        bn, bk, warps = 4, 2048, 8          # down: 14.2 us for 33.6 MB
    elif N <= K:
        bn, bk, warps = 4, 2048, 1          # o: 5.0 us for 8.4 MB
    else:
        bn, bk, warps = 4, 1024, 1          # qkv 6.7 us / 12.6 MB, gate_up 20.1 us / 67 MB
    bm = triton.next_power_of_2(M)
    return bn, max(32, min(bk, triton.next_power_of_2(K), 8192 // (bm * bn))), warps, 1


# (N, K) -> the launch at M = 1 on CUDA, from benchmarks/sweep_gemv.py on an H200:
#   ("tiled", BLOCK_N, BLOCK_K, num_warps, PRE) or ("persistent", BLOCK_N, num_warps, programs per SM, DEPTH)
GEMV_CONFIGS: dict[tuple[int, int], tuple] = {
    # Llama-3.1-8B (sweep of 324 configs, --rep 25; the tiled rule in brackets): qkv 16.6 us, 71% of copy BW
    # [20.2, 59%]; o 11.4 us, 70% [13.0, 61%]; gate_up 60.0 us, 92% [74.9, 74%]; down 35.2 us, 79% [37.6, 74%]
    (6144, 4096): ("persistent", 2, 4, 3, 1),
    (4096, 4096): ("persistent", 2, 8, 3, 1),
    (28672, 4096): ("persistent", 2, 4, 3, 1),
    (4096, 14336): ("tiled", 8, 2048, 4, 0),
    # Llama-3.2-1B down (sweep: 12.2 us, 65% [13.2, 60%]); batch 1 with PDL on: 0.92 ms/token vs 0.94 tiled
    (2048, 8192): ("persistent", 1, 8, 2, 1),
    # Llama-3.1-8B as one of two tensor-parallel ranks holds it (sweep_gemv.py --tp 2): qkv 9.9 us, 60% [13.2, 45%];
    # o 7.2 us, 55% [7.5, 53%]; gate_up 32.5 us, 86% [40.7, 68%]; down 19.6 us, 71% [22.1, 63%]
    (3072, 4096): ("persistent", 2, 4, 3, 1),
    (4096, 2048): ("tiled", 4, 1024, 4, 0),
    (14336, 4096): ("persistent", 2, 4, 3, 1),
    (4096, 7168): ("tiled", 4, 1024, 4, 0),
}
# persistent table entries measured faster with PDL on than off (1B down: 0.92 vs 0.96 ms/token on an H200):
# they leave enable_pdl=None's PDL on (persistent_linears skips them)
PERSISTENT_PDL_OK = {(2048, 8192)}
GEMV_VARIANTS = ("auto", "tiled", "persistent")
PERSISTENT_MAX_ELEMS = 16384             # BLOCK_M * next_pow2(K) held in registers by the persistent variant


def tuned_config(N: int, K: int) -> tuple | None:
    return GEMV_CONFIGS.get((N, K))


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3                                                 # interpreter: a small grid, several tiles each


def resolve_config(M: int, N: int, K: int, variant: str, device: torch.device) -> tuple:
    """The launch of one fused_linear call: ("tiled", BN, BK, warps, stages, PRE) or
    ("persistent", BN, warps, programs per SM, DEPTH).
    variant "tiled": gemv_config's rule (the previous default); "persistent": the table's persistent entry or a
    default one; "auto": the tuned table at M = 1 on CUDA, else the rule. The persistent variant needs the
    whole activation row in registers (BLOCK_M * next_pow2(K) <= PERSISTENT_MAX_ELEMS), else the tiled one runs."""
    assert variant in GEMV_VARIANTS, variant
    fits = triton.next_power_of_2(M) * triton.next_power_of_2(K) <= PERSISTENT_MAX_ELEMS
    cfg = None
    if variant == "persistent" and fits:
        cfg = tuned_config(N, K) if device.type == "cuda" else None
        if cfg is None or cfg[0] != "persistent":
            cfg = ("persistent", 2 if K <= 4096 else 1, 8, 2, 2)
    elif variant == "auto" and M == 1 and device.type == "cuda":
        cfg = tuned_config(N, K)
        if cfg is not None and cfg[0] == "persistent" and not fits:
            cfg = None
    if cfg is None:
        return ("tiled", *gemv_config(M, N, K), 0)
    return _normalize(cfg, M, K)


def persistent_linears(mcfg, variant: str, device: torch.device) -> list[tuple[int, int]]:
    """(N, K) of the decode linears (o, gate_up, down, and q/k/v where it is a plain fused linear) that take the
    persistent variant at M = 1 (but those of PERSISTENT_PDL_OK). EngineConfig.enable_pdl=None turns PDL off for
    such a model: the persistent grid assumes its programs spread evenly over the SMs, and at the 8B shape on
    an H200 the step was 4.87 ms with PDL, 4.44 without (our reading, not profiled: programs launched early
    land where the previous kernel left room)."""
    h, i, d = mcfg.hidden_size, mcfg.intermediate_size, mcfg.head_dim
    shapes = [(h, mcfg.num_heads * d), (2 * i, h), (h, i)]
    if mcfg.qk_norm:
        shapes.append(((mcfg.num_heads + 2 * mcfg.num_kv_heads) * d, h))
    return [(N, K) for N, K in shapes if (N, K) not in PERSISTENT_PDL_OK
            and resolve_config(1, N, K, variant, torch.device(device))[0] == "persistent"]


def _normalize(cfg: tuple, M: int, K: int) -> tuple:
    """An explicit config -> resolve_config's form: a 4-tuple (BN, BK, warps, stages) is the tiled kernel."""
    if cfg[0] == "persistent":
        return tuple(cfg)
    if cfg[0] == "tiled":
        _, bn, bk, warps, pre = cfg
        bm = triton.next_power_of_2(M)
        bk = max(32, min(bk, triton.next_power_of_2(K), max(32, 32768 // (bm * bn))))
        return ("tiled", bn, bk, warps, 1, pre)
    bn, bk, warps, stages = cfg
    return ("tiled", bn, bk, warps, stages, 0)


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
                 residual: torch.Tensor | None = None, pdl: bool = False, variant: str = "auto",
                 config: tuple | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] for silu_mul) -> [M, N] = prologue(x) @ weight.T (+ bias) (+ residual).
    weight [N, K] with contiguous rows; M is small (a decode step). pdl: launch as a programmatic dependent
    of the previous kernel (see pdl_supported), overlapping its tail with this kernel's first weight fetch.
    variant: "auto" (the tuned table), "tiled" or "persistent" (EngineConfig.gemv_variant; see resolve_config);
    config: an explicit launch (a sweep), overriding variant."""
    M = x.shape[0]
    N, K = weight.shape
    assert weight.stride(-1) == 1
    check_gemv_args(x, N, K, prologue, norm_weight, residual)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = _normalize(config, M, K) if config is not None else resolve_config(M, N, K, variant, x.device)
    args = (x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
            residual if residual is not None else out, out, M, N, K,
            x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), eps)
    flags = dict(PROLOGUE=PROLOGUES[prologue], HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                 USE_PDL=pdl, BLOCK_M=max(1, triton.next_power_of_2(M)), **({"launch_pdl": True} if pdl else {}))
    if cfg[0] == "persistent":
        _, bn, warps, per_sm, depth = cfg
        grid = max(1, min(triton.cdiv(N, bn), per_sm * num_sms(x.device)))
        _gemv_persistent_kernel[(grid,)](*args, BLOCK_N=bn, BLOCK_K=triton.next_power_of_2(K), DEPTH=depth,
                                         num_warps=warps, num_stages=1, **flags)
    else:
        _, bn, bk, warps, stages, pre = cfg
        _gemv_kernel[(triton.cdiv(N, bn),)](*args, BLOCK_N=bn, BLOCK_K=bk, PRE=pre, num_warps=warps,
                                            num_stages=stages, **flags)
    return out


def fused_linear_ref(x, weight, bias=None, *, prologue=None, norm_weight=None, eps=1e-6, residual=None, pdl=False,
                     variant="auto"):
    return torch_ops.fused_linear(x, weight, bias, prologue=prologue, norm_weight=norm_weight, eps=eps,
                                  residual=residual)
