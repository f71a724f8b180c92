"""The two-launch FP8 GEMM (engine/kernels/quant_gemm_fp8.py) against torch, under the Triton interpreter on CPU
(the GPU test_gpu_quant.py checks it at 8B sizes on real fp8 conversions), and EngineConfig.fp8_gemm's checks."""
import pytest
import torch

from engine import EngineConfig
from engine.kernels.quant_gemm_fp8 import fp8_matmul, gemm_fp8, quantize_activations_fp8
from engine.quant.formats import BLOCK, FP8_DTYPE, FP8_MAX, dequantize, quantize
from engine.quant.linear import QuantLinear, set_fp8_gemm


def _exact_activations(M: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] whose every 128-group is fp8 codes (one of them +-448) times a power of two: quantizing it is
    exact, so the kernel's output is known without rounding (the interpreter's fp32 -> fp8 cast rounds wrongly
    near binade edges; the GPU test covers rounding). Returns x, its codes and its group scales [M, K / 128]."""
    g = torch.Generator().manual_seed(seed)
    kb = -(-K // BLOCK)
    codes = (torch.randn(M, kb * BLOCK, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    codes = codes[:, :K].clone()
    for j in range(kb):                                   # the group's largest magnitude is exactly 448
        codes[:, j * BLOCK] = FP8_MAX * torch.where(torch.rand(M, generator=g) < 0.5, -1.0, 1.0)
    scales = 2.0 ** torch.randint(-12, 0, (M, kb), generator=g).float()
    x = codes * scales.repeat_interleave(BLOCK, 1)[:, :K]
    return x, codes, scales


@pytest.mark.parametrize("M,K", [(1, 128), (5, 300), (37, 256), (70, 130)])
def test_activation_quantization_exact(M, K):
    x, codes, scales = _exact_activations(M, K, seed=M + K)
    q, s = quantize_activations_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == (M, K)
    assert s.shape == (M, -(-K // BLOCK)) and s.stride(0) == 1          # column-major, as cuBLAS reads it
    assert torch.equal(s, scales)
    assert torch.equal(q.float(), codes)
    qp, sp = quantize_activations_fp8(x, row_align=16)           # cuBLAS's padded rows: zeros
    Mp = -(-M // 16) * 16
    assert qp.shape == (Mp, K) and sp.shape == (Mp, s.shape[1]) and sp.stride() == (1, Mp)
    assert torch.equal(qp[:M].float(), codes) and torch.equal(sp[:M], scales)
    assert not qp[M:].float().any()


def test_activation_quantization_zero_rows():
    q, s = quantize_activations_fp8(torch.zeros(3, 256))
    assert torch.equal(q.float(), torch.zeros(3, 256)) and bool((s > 0).all())      # no 0 / 0


@pytest.mark.parametrize("M,N,K", [(3, 136, 300), (37, 200, 256), (70, 130, 140)])
@pytest.mark.parametrize("config", [None, (16, 64, 4, 2), (32, 128, 4, 3)])
def test_gemm_fp8_matches_torch(M, N, K, config):
    torch.manual_seed(M * N)
    x, codes, scales = _exact_activations(M, K, seed=K)
    t = quantize(torch.randn(N, K) * 0.02, "fp8")
    bias = torch.randn(N)
    q, s = quantize_activations_fp8(x)
    y = gemm_fp8(q, s, t["weight"], t["weight_scale_inv"], torch.float32, bias, config=config)
    ref = x @ dequantize("fp8", t, (N, K)).t() + bias
    assert float((y - ref).norm() / ref.norm()) < 1e-5
    y2 = fp8_matmul(x, t, bias, "triton")
    assert float((y2 - ref).norm() / ref.norm()) < 1e-5


def test_fp8_gemm_config_checks():
    with pytest.raises(ValueError, match="fp8_gemm"):
        EngineConfig(model="dummy:llama-3.2-1b", fp8_gemm="cutlass")
    lin = QuantLinear("fp8", 256, 128, None, "cpu")
    lin.act_fp8 = True

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.mlp = torch.nn.Module()
            self.self_attn.qkv_proj, self.self_attn.o_proj = lin, QuantLinear("fp8", 128, 128, None, "cpu")
            self.mlp.gate_up_proj, self.mlp.down_proj = QuantLinear("int8", 128, 128, None, "cpu"), lin

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Layer()])
    set_fp8_gemm(model, "auto")                          # no cuBLAS block-wise scaled_mm on a CPU
    assert lin.fp8_gemm == "triton"
    with pytest.raises(ValueError, match="fp8_gemm.*cublas"):
        set_fp8_gemm(model, "cublas")
    with pytest.raises(ValueError, match="fp8_gemm"):
        EngineConfig(model="dummy:llama-3.2-1b", fp8_gemm="fused")

