"""FP8 w8a8 GEMM for steps above the decode GEMV (large decode batches, prefill chunks), in two launches: the
activations are quantized once per token and 128-group (dynamic scales, the numerics the block-wise FP8
checkpoints were calibrated for), then multiplied on FP8 tensor cores against the 128x128-block weights.

quant_gemm.py's ACT_FP8 kernel quantizes inside the GEMM, so every N tile re-quantizes the same activations
(N / BLOCK_N times over: 224 at the 8B gate_up); here they are quantized once, and the GEMM's loop is loads and
one FP8 dot per 128-wide k-block. Two GEMMs: a Triton one (vLLM's w8a8_block_fp8_matmul recipe) and cuBLAS's
block-wise scaled_mm (torch's BlockWise1x128 x BlockWise128x128, CUDA >= 12.9 on sm90), where torch has it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.formats import BLOCK, FP8_DTYPE, FP8_MAX

CUBLAS_ROW_ALIGN = 4         # cuBLAS's block-wise scaled_mm: M a multiple of 4 (M = 1, 2, 3, 5, 17 are NOT_SUPPORTED)


@triton.jit
def _act_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, M, Mp, K, stride_xm, stride_qm, stride_sk, FMAX: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [M, K] -> q [Mp, K] fp8 and s [K / BLOCK_K, Mp] fp32: s[g, m] = max(|x[m, group g]|) / FMAX; rows M..Mp
    (padding) quantize zeros."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    offs_k = g * BLOCK_K + tl.arange(0, BLOCK_K)
    mm = offs_m < Mp
    km = (offs_k < K)[None, :]
    mask = mm[:, None] & km
    rows = offs_m[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=(offs_m < M)[:, None] & km,
                other=0.0).to(tl.float32)                                                          # [BM, BK]
    # IEEE divisions (Triton's "/" is approximate): the codes and scales are torch's, bit for bit
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), FMAX)                             # [BM]
    q = tl.div_rn(x, s[:, None]).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows * stride_qm + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + g * stride_sk + offs_m, s, mask=mm)


def quantize_activations_fp8(x: torch.Tensor, row_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [Mp, K] float8_e4m3fn, s [Mp, K / 128] fp32, column-major: a [K / 128, Mp] buffer's
    transposed view, the layout cuBLAS's block-wise scaled_mm reads), Mp = M rounded up to row_align (rows past M
    are zeros). As formats.quantize_activations_fp8_ref."""
    assert x.stride(-1) == 1
    M, K = x.shape
    Mp = -(-M // row_align) * row_align
    q = torch.empty((Mp, K), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((triton.cdiv(K, BLOCK), Mp), dtype=torch.float32, device=x.device)
    kb = s.shape[0]
    if Mp:
        bm = 8
        _act_quant_fp8_kernel[(triton.cdiv(Mp, bm), kb)](x, q, s, M, Mp, K, x.stride(0), q.stride(0), s.stride(0),
                                                          FMAX=FP8_MAX, BLOCK_M=bm, BLOCK_K=BLOCK, num_warps=4)
    return q, s.t()


@triton.jit
def _gemm_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_am, stride_ask, stride_wn,
                     stride_wsn, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """out [M, N] = sum over k-blocks of (a . w^T) * a_scale [BM] * w_scale [BN]; a, w fp8, BLOCK_K = 128."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am                  # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn                  # [BN, 1]
    ws_rows = ws_ptr + (offs_n // BLOCK_K) * stride_wsn                         # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        km = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=mm[:, None] & km[None, :], other=0.0)        # [BM, BK]
        w = tl.load(w_rows + offs_k[None, :], mask=nm[:, None] & km[None, :], other=0.0)        # [BN, BK]
        a_s = tl.load(as_ptr + kb * stride_ask + offs_m, mask=mm, other=0.0)                      # [BM]
        w_s = tl.load(ws_rows + kb, mask=nm, other=0.0)                                           # [BN]
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def gemm_fp8_config(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the number of rows: benchmarks/sweep_quant_gemm.py --quick's
    winners summed over the 8B projections on an H200 (quant_gemm_nvidia-h200_llama-3.1-8b.json)."""
    if M <= 32:
        return 16, 64, 4, 4
    return 64, 128, 8, 4


def gemm_fp8(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
             bias: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q [M, K] fp8 with s [M, K / 128] (quantize_activations_fp8) times w [N, K] fp8 with ws [N / 128, K / 128]
    -> [M, N] in out_dtype (+ bias)."""
    M, K = q.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=q.device)
    if M == 0:
        return out
    bm, bn, warps, stages = config or gemm_fp8_config(M)
    st = s.t()                                                  # [K / 128, M] rows of scales
    _gemm_fp8_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        q, st, w, ws, bias if bias is not None else w, out, M, N, K, q.stride(0), st.stride(0), w.stride(0),
        ws.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK,
        num_warps=warps, num_stages=stages)
    return out


def cublas_supported(N: int, K: int) -> bool:
    """Whether torch can run this [N, K] weight's GEMM on cuBLAS's block-wise FP8 scaled_mm here."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return False
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    kb = -(-K // BLOCK)
    return cuda >= (12, 9) and hasattr(torch.nn.functional, "scaled_mm") and N % BLOCK == 0 and K % BLOCK == 0 \
        and kb % 4 == 0


def gemm_fp8_cublas(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """gemm_fp8's contract on cuBLAS (see cublas_supported)."""
    F = torch.nn.functional
    st = F.ScalingType
    y = F.scaled_mm(q, w.t(), s, st.BlockWise1x128, ws.t(), st.BlockWise128x128, output_dtype=out_dtype)
    return y if bias is None else y + bias


def fp8_matmul(x: torch.Tensor, qt: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
               gemm: str = "triton") -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: activations quantized per token-group, then the FP8 GEMM (gemm: triton |
    cublas)."""
    w, ws = qt["weight"], qt["weight_scale_inv"]
    M = x.shape[0]
    q, s = quantize_activations_fp8(x, CUBLAS_ROW_ALIGN if gemm == "cublas" else 1)
    if gemm == "cublas":
        return gemm_fp8_cublas(q, s, w, ws, x.dtype, bias)[:M]
    return gemm_fp8(q, s, w, ws, x.dtype, bias)[:M]
