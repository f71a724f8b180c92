"""The tensor-core quantized GEMV (engine/kernels/quant_gemv_tc.py) and the q/k/v + RoPE kernel with its dot,
against dequantize-then-matmul (interpreter, odd sizes): every format, prologue and epilogue, M = 1 (the
prologue on one row, then padded), 3 and 16, the dot in the activation dtype (DOT 0) and in fp16 (DOT 1)."""
import pytest
import torch

from engine import EngineConfig
from engine.kernels.quant_gemv import quant_fused_linear, quant_fused_linear_ref
from engine.kernels.quant_gemv_tc import QUANT_GEMV_TC_CONFIGS, quant_gemv_tc_config
from engine.quant.formats import dequantize, quantize
from engine.quant.linear import QuantLinear, set_tensor_cores
from helpers import every_code_weight

CASES = [(f, 128, p) for f in ("fp8", "int8", "int4") for p in (None, "rms_norm", "silu_mul")] + [("int4", 32, None)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,group,prologue", CASES)
def test_tc_gemv_matches_reference(fmt, group, prologue):
    """N = 133 over two 128-row fp8 scale blocks (BLOCK_N 64 divides 128: two programs in the first block, one in
    the second), K = 333 not a multiple of the k step nor of the group; bias and residual epilogue."""
    torch.manual_seed(1)
    N, K = 133, 333
    t = quantize(torch.randn(N, K) * 0.05, fmt, group)
    bk = 256 if group == 128 else 64
    for M, dtype, dot in ((1, torch.float32, 0), (3, torch.float16, 0), (16, torch.float32, 1), (1, torch.float32, 1)):
        x = torch.randn(M, 2 * K if prologue == "silu_mul" else K).to(dtype)
        kw = dict(prologue=prologue, norm_weight=(torch.rand(K) + 0.5).to(dtype), eps=1e-5,
                  residual=torch.randn(M, N).to(dtype))
        bias = torch.randn(N).to(dtype)
        y = quant_fused_linear(x, fmt, t, (N, K), bias, tensor_cores=True, config=(64, bk, 1, 2, dot), **kw)
        ref = quant_fused_linear_ref(x, fmt, t, (N, K), bias, **kw)
        # fp32 dots are exact up to summation order; fp16 operands round the activation (2^-11)
        tol = 1e-4 if (dtype, dot) == (torch.float32, 0) else 2e-2
        torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_tc_gemv_decodes_every_code_exactly(fmt):
    """One-hot activation rows read the weight back column by column: each decode (into fp32, and into fp16 with
    int4's 1024 offset undone on the sums) gives every code's exact value."""
    N, K = 16, 256
    t = every_code_weight(fmt, N, K)
    w = dequantize(fmt, t, (N, K))
    cols = [0, 1, 2, 63, 64, 65, 127, 128, 200, 255]
    x = torch.eye(K)[cols]                                             # [M = 10, K] one-hot rows, fp32
    for dot in (0, 1):
        y = quant_fused_linear(x, fmt, t, (N, K), tensor_cores=True, config=(16, 256 if fmt != "int4" else 128,
                                                                                1, 2, dot))
        assert torch.equal(y, w[:, cols].T), (fmt, dot)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,group", [("fp8", 128), ("int8", 128), ("int4", 32)])
def test_tc_qkv_rope_store_matches_reference(fmt, group):
    """The q/k/v + RoPE + KV-store kernel on the tensor-core dot (16 rows a program: 8 rotation pairs): q and the
    caches; a padding slot stores nothing; fp8's 160 rows span two scale blocks."""
    from engine.kernels.quant_qkv_rope import quant_fused_qkv_rope_store, quant_fused_qkv_rope_store_ref
    torch.manual_seed(4)
    (H, Hk), D, K, bs = ((3, 1) if fmt == "fp8" else (2, 1)), 32, 200, 4
    N = (H + 2 * Hk) * D
    t = quantize(torch.randn(N, K) * 0.05, fmt, group)
    cos_sin = torch.randn(64, D)
    bk = 256 if group == 128 else 64
    for M, dtype, bias, cfg in ((1, torch.float32, False, (16, bk, 2, 2, 0)), (3, torch.float16, True, None),
                                (16, torch.float32, True, (16, bk, 1, 2, 1))):
        x = torch.randn(M, K).to(dtype)
        nw = (torch.rand(K) + 0.5).to(dtype)
        b = torch.randn(N).to(dtype) if bias else None
        positions = torch.randint(0, 64, (M,))
        slots = torch.tensor([5, -1, 9] + list(range(10, 23)))[:M]
        kc, vc = torch.randn(6, bs, Hk, D).to(dtype), torch.randn(6, bs, Hk, D).to(dtype)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q = quant_fused_qkv_rope_store(x, fmt, t, (N, K), b, nw, 1e-5, H, Hk, positions, cos_sin, kc, vc, slots,
                                       tensor_cores=True, config=cfg)
        q_ref = quant_fused_qkv_rope_store_ref(x, fmt, t, (N, K), b, nw, 1e-5, H, Hk, positions, cos_sin, kc_ref,
                                               vc_ref, slots)
        tol = 1e-4 if (dtype, cfg[-1] if cfg else 1) == (torch.float32, 0) else 2e-2
        torch.testing.assert_close(q.float(), q_ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(kc.float(), kc_ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(vc.float(), vc_ref.float(), atol=tol, rtol=tol)


def test_tc_fp16_dot_saturates_large_activations():
    """fp16 operands (DOT 1) hold activations up to 65504: larger ones saturate (no inf / nan in the output)."""
    torch.manual_seed(3)
    N, K = 40, 160
    t = quantize(torch.randn(N, K) * 0.05, "int8")
    x = torch.randn(1, K)
    x[0, 7], x[0, 100] = 1e6, -3e5
    y = quant_fused_linear(x, "int8", t, (N, K), tensor_cores=True, config=(16, 128, 1, 2, 1))
    ref = quant_fused_linear_ref(x.clamp(-65504, 65504), "int8", t, (N, K))
    assert bool(torch.isfinite(y).all())
    torch.testing.assert_close(y, ref, atol=1e-2, rtol=2e-3)


def test_tc_config_table_and_rule():
    for (fmt, N, K), cfg in QUANT_GEMV_TC_CONFIGS.items():
        assert quant_gemv_tc_config(fmt, 1, N, K) == cfg
        assert cfg[0] >= 16 and (fmt != "fp8" or (128 % cfg[0] == 0 and cfg[1] % 128 == 0))
    bn, bk, warps, stages, dot = quant_gemv_tc_config("fp8", 1, 999, 333)
    assert bn >= 16 and 128 % bn == 0 and bk % 128 == 0 and warps * 8 <= bn and dot == 1
    assert quant_gemv_tc_config("int8", 1, 999, 333)[4] == 0         # int8 -> fp16 would convert every weight
    t = quantize(torch.randn(32, 64), "int8")
    with pytest.raises(AssertionError, match="at most 16 rows"):
        quant_fused_linear(torch.randn(17, 64), "int8", t, (32, 64), tensor_cores=True)
    with pytest.raises(AssertionError, match="packed"):             # inline PTX: int4, compiled kernels only
        quant_fused_linear(torch.randn(1, 64), "int8", t, (32, 64), tensor_cores=True, config=(16, 64, 1, 2, 2))


def test_quant_linear_switch():
    """EngineConfig.quant_gemv_tensor_cores is validated; set_tensor_cores routes a QuantLinear's fused GEMV to
    the tensor-core kernel up to 16 rows (same result as the reference), the CUDA-core one above."""
    with pytest.raises(ValueError, match="quant_gemv_tensor_cores"):
        EngineConfig(quant_gemv_tensor_cores="yes")
    torch.manual_seed(2)
    N, K = 48, 96
    t = quantize(torch.randn(N, K) * 0.05, "fp8")
    lin = QuantLinear("fp8", K, N, None, "cpu", tensors=t)
    lin.kernels = "triton"

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = torch.nn.Module(), torch.nn.Module()
            self.self_attn.qkv_proj, self.self_attn.o_proj = lin, torch.nn.Linear(1, 1)
            self.mlp.gate_up_proj, self.mlp.down_proj = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Layer()])
    set_tensor_cores(model, True)
    assert lin.tensor_cores
    x = torch.randn(2, K)
    ref = quant_fused_linear_ref(x, "fp8", t, (N, K))
    torch.testing.assert_close(lin.fused(x), ref, atol=2e-2, rtol=2e-2)
    set_tensor_cores(model, False)
    assert not lin.tensor_cores
    torch.testing.assert_close(lin.fused(x), ref, atol=1e-4, rtol=1e-4)
    set_tensor_cores(model, None)                   # auto: only the shapes the sweep found faster on tensor cores
    assert lin.tensor_cores == (("fp8", N, K) in QUANT_GEMV_TC_CONFIGS) and not lin.tensor_cores
    QUANT_GEMV_TC_CONFIGS[("fp8", N, K)] = (16, 128, 1, 2, 1)
    try:
        set_tensor_cores(model, None)
        assert lin.tensor_cores
        torch.testing.assert_close(lin.fused(x), ref, atol=2e-2, rtol=2e-2)
    finally:
        del QUANT_GEMV_TC_CONFIGS[("fp8", N, K)]
