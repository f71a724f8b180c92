"""GPU-only: the packed-word decode GEMV (quant_gemv_packed.py) compiled, with its inline-PTX decodes, at the 8B
sizes against the reference; every code exact; split-K repeated (workspace reset) and under a CUDA graph; the
q/k/v + RoPE kernel on it; an engine with EngineConfig.quant_gemv_packed on against the torch path."""
import pytest
import torch

from engine.kernels.quant_gemv import quant_fused_linear_ref
from engine.kernels.quant_gemv_packed import quant_fused_linear_packed, quant_gemv_packed_config
from engine.quant.formats import dequantize, int4_to_words, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("flags", [0, 1, 3])
def test_packed_full_size(fmt, flags):
    torch.manual_seed(0)
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda") * 0.02
        t = quantize(w, fmt)
        if fmt == "int4":
            t = int4_to_words(t)
        for M, prologue, split in ((1, "rms_norm", 1), (1, "silu_mul", 4), (4, "rms_norm", 2), (1, None, 2)):
            x = torch.randn(M, 2 * K if prologue == "silu_mul" else K, device="cuda", dtype=torch.bfloat16)
            kw = dict(prologue=prologue, norm_weight=torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5,
                      residual=torch.randn(M, N, device="cuda", dtype=torch.bfloat16))
            bn, bk, warps, _, _ = quant_gemv_packed_config(fmt, M, N, K)
            cfg = (bn, bk, warps, split, flags)
            y = quant_fused_linear_packed(x, fmt, t, (N, K), config=cfg, **kw)
            ref = quant_fused_linear_ref(x.float(), fmt, t, (N, K), **{**kw, "norm_weight": kw["norm_weight"].float(),
                                                                      "residual": kw["residual"].float()})
            assert _rel(y, ref) < 1e-2, (name, M, prologue, split, _rel(y, ref))
            y2 = quant_fused_linear_packed(x, fmt, t, (N, K), config=cfg, **kw)
            assert torch.equal(y, y2) or _rel(y2, y) < 1e-3, (name, "second call")   # split-K: atomics reorder


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_packed_decodes_every_code_exactly(fmt):
    """One-hot bf16 activations through the inline-PTX decodes: every code of the format read back exactly."""
    K = 256
    if fmt == "int4":
        codes = torch.arange(16).repeat(2 * K // 16)[: 2 * K].view(2, K).to(torch.uint8)
        packed = codes.view(2, -1, 2, 64)
        t = int4_to_words({"qweight": (packed[:, :, 0] | (packed[:, :, 1] << 4)).view(2, -1),
                           "scales": torch.ones(2, 2, dtype=torch.float16),
                           "mins": torch.zeros(2, 2, dtype=torch.float16)})
    elif fmt == "int8":
        t = {"weight": torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(1, K).repeat(2, 1),
             "weight_scale": torch.ones(2, 1)}
    else:
        b = torch.arange(256, dtype=torch.int16).to(torch.uint8)
        b[(b & 127) == 127] = 0                                   # NaN codes: 0 x NaN would poison the one-hot dot
        t = {"weight": b.view(torch.float8_e4m3fn).view(1, K).repeat(2, 1), "weight_scale_inv": torch.ones(1, 2)}
    t = {k: v.cuda() for k, v in t.items()}
    w = dequantize(fmt, t, (2, K))
    ok = torch.isfinite(w[0]).nonzero().flatten()
    x = torch.eye(K, device="cuda", dtype=torch.bfloat16)[ok]
    y = torch.cat([quant_fused_linear_packed(x[i:i + 1], fmt, t, (2, K), config=(2, 128, 1, 1, 1))
                   for i in range(x.shape[0])])
    exp = w[:, ok].T.to(torch.bfloat16)
    assert torch.equal(y, exp), (y[y != exp][:8], exp[y != exp][:8])


def test_packed_split_k_under_cuda_graph():
    torch.manual_seed(1)
    N, K = 4096, 14336
    t = int4_to_words(quantize(torch.randn(N, K, device="cuda") * 0.02, "int4"))
    x = torch.randn(1, 2 * K, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    cfg = (16, 1024, 1, 4, 3)
    eager = quant_fused_linear_packed(x, "int4", t, (N, K), prologue="silu_mul", residual=r, config=cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = quant_fused_linear_packed(x, "int4", t, (N, K), prologue="silu_mul", residual=r, config=cfg)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert _rel(out, eager) < 1e-3


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_packed_qkv_rope_full_size(fmt):
    from engine.kernels.quant_qkv_rope import quant_fused_qkv_rope_store, quant_fused_qkv_rope_store_ref
    torch.manual_seed(2)
    H, Hk, D, K, bs = 32, 8, 128, 4096, 16
    N = (H + 2 * Hk) * D
    t = quantize(torch.randn(N, K, device="cuda") * 0.02, fmt)
    if fmt == "int4":
        t = int4_to_words(t)
    cos_sin = torch.randn(64, D, device="cuda")
    for M in (1, 3):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
        pos = torch.randint(0, 64, (M,), device="cuda")
        slots = torch.tensor([5, -1, 9][:M], device="cuda")
        kc = torch.zeros(4, bs, Hk, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        kr, vr = kc.float(), vc.float()
        q = quant_fused_qkv_rope_store(x, fmt, t, (N, K), None, nw, 1e-5, H, Hk, pos, cos_sin, kc, vc, slots,
                                       packed=True)
        qr = quant_fused_qkv_rope_store_ref(x.float(), fmt, t, (N, K), None, nw.float(), 1e-5, H, Hk, pos, cos_sin,
                                            kr, vr, slots)
        assert _rel(q, qr) < 1e-2, _rel(q, qr)
        assert _rel(kc, kr) < 1e-2 and _rel(vc, vr) < 1e-2


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_engine_packed_graphs_match_torch_fp32(fmt):
    """fp32, CUDA graphs, quant_gemv_packed on (int4 in the words layout: its GEMM for the prefill, the packed GEMVs
    for the decode): the first two tokens of each request are the torch path's."""
    from test_gpu_quant import _run
    ref = _run(dtype="float32", quantization=fmt, kernels="torch", enable_cuda_graphs=False)
    got = _run(dtype="float32", quantization=fmt, kernels="triton", fp8_activations=False,
               quant_gemv_tensor_cores=False, quant_gemv_packed=True)
    assert [r[:2] for r in ref] == [g[:2] for g in got]
