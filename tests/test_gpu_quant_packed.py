"""GPU-only: the packed-word decode GEMV (quant_gemv_packed.py) compiled, with its inline-PTX decodes, at the 8B
sizes against the reference; every code exact; split-K repeated (workspace reset) and under a CUDA graph; the
q/k/v + RoPE kernel on it; an engine with EngineConfig.quant_gemv_packed on against the torch path.

Each case is a few kernel variants (compiles dominate: ~1-3 s each), so the file runs in about a minute. Every
sub-case's error goes into the assertion message, and to packed_errors.jsonl in the folder that
KVSCOPE_TEST_RECORD_DIR names (when set), so one run tells which sub-case failed."""
import json
import os

import pytest
import torch

from engine.kernels.quant_gemv import quant_fused_linear_ref
from engine.kernels.quant_gemv_packed import quant_fused_linear_packed
from engine.kernels.quant_packed_configs import quant_gemv_packed_config
from engine.quant.formats import dequantize, int4_to_words, quantize
from helpers import every_code_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# the engine's fusions per projection: (prologue, residual)
USE = {"qkv": ("rms_norm", False), "o": (None, True), "gate_up": ("rms_norm", False), "down": ("silu_mul", True)}
TOL = 1e-2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _record(test, rows):
    if os.environ.get("KVSCOPE_TEST_RECORD_DIR"):
        with open(os.path.join(os.environ["KVSCOPE_TEST_RECORD_DIR"], "packed_errors.jsonl"), "a") as f:
            f.write(json.dumps({"test": test, "rows": rows}) + "\n")


def _weights(fmt, N, K, seed=0):
    torch.manual_seed(seed)
    t = quantize(torch.randn(N, K, device="cuda") * 0.02, fmt)
    return int4_to_words(t) if fmt == "int4" else t


def _case(fmt, t, name, M, prologue, residual, cfg=None, rows_on_grid=None, seed=1):
    """One call against the fp32 reference, and a second call (split-K: the workspace left zero)."""
    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, 2 * K if prologue == "silu_mul" else K, device="cuda", generator=g).bfloat16()
    nw = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16()
    r = torch.randn(M, N, device="cuda", generator=g).bfloat16() if residual else None
    cfg = cfg or quant_gemv_packed_config(fmt, M, N, K)
    kw = dict(prologue=prologue, norm_weight=nw, residual=r, config=cfg, rows_on_grid=rows_on_grid)
    y = quant_fused_linear_packed(x, fmt, t, (N, K), **kw)
    y2 = quant_fused_linear_packed(x, fmt, t, (N, K), **kw)
    ref = quant_fused_linear_ref(x.float(), fmt, t, (N, K), prologue=prologue, norm_weight=nw.float(),
                                 residual=None if r is None else r.float())
    return dict(shape=name, M=M, prologue=prologue, residual=residual, cfg=list(cfg), rows_on_grid=rows_on_grid,
                rel=_rel(y, ref), rerun=0.0 if torch.equal(y, y2) else _rel(y2, y))


def test_gemm_int4_group_dots_full_size():
    """EngineConfig.quant_gemm_group_dots: the int4 words GEMM at a 128-token prefill, 8B shapes, vs fp32."""
    from engine.kernels.quant_gemm import quant_matmul, quant_matmul_ref
    rows = []
    for name in ("qkv", "down"):
        N, K = SHAPES[name]
        t = _weights("int4", N, K)
        x = torch.randn(128, K, device="cuda").bfloat16()
        ref = quant_matmul_ref(x.float(), "int4", t, (N, K))
        for dots in (False, True):
            y = quant_matmul(x, "int4", t, (N, K), group_dots=dots)
            rows.append(dict(shape=name, dots=dots, rel=_rel(y, ref), rerun=0.0))
    _check("gemm_int4_group_dots", rows)


def _check(test, rows):
    _record(test, rows)
    bad = [r for r in rows if not (r["rel"] < TOL and r["rerun"] < 1e-3)]
    assert not bad, "\n".join(json.dumps(r) for r in bad)


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_packed_full_size(fmt, M):
    """Every 8B projection at the engine's config (QUANT_GEMV_PACKED_CONFIGS / the rule, its decode and split),
    with the engine's fusions; at M = 1 also another split and prologue."""
    rows = []
    for name, (N, K) in SHAPES.items():
        t = _weights(fmt, N, K)
        prologue, res = USE[name]
        rows.append(_case(fmt, t, name, M, prologue, res))
        if M == 1:
            bn, bk, warps, split, flags = quant_gemv_packed_config(fmt, M, N, K)
            other = {None: "rms_norm", "rms_norm": None, "silu_mul": "rms_norm"}[prologue]
            rows.append(_case(fmt, t, name, M, other, True, (bn, bk, warps, 2 if split == 1 else 1, flags)))
        del t
    _check(f"full_size[{fmt}-{M}]", rows)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_packed_plain_decode_full_size(fmt):
    """The plain (non-PTX) decode, flags 0, on the 4096-row projections: M = 1 without and with split-K, M = 4."""
    rows = []
    for name in ("o", "down"):
        t = _weights(fmt, *SHAPES[name])
        for M, split in ((1, 1), (1, 4), (4, 2)):
            bn, bk, warps, _, _ = quant_gemv_packed_config(fmt, M, *SHAPES[name])
            rows.append(_case(fmt, t, name, M, "rms_norm", True, (bn, bk, warps, split, 0)))
        del t
    _check(f"plain_decode[{fmt}]", rows)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_packed_decodes_every_code_exactly(fmt):
    """One-hot bf16 activations through the inline-PTX decodes: every code of the format read back exactly."""
    K = 256
    t = every_code_weights(fmt, K)
    t = {k: v.cuda() for k, v in t.items()}
    w = dequantize(fmt, t, (2, K))
    ok = torch.isfinite(w[0]).nonzero().flatten()
    x = torch.eye(K, device="cuda", dtype=torch.bfloat16)[ok]
    y = torch.cat([quant_fused_linear_packed(x[i:i + 1], fmt, t, (2, K), config=(2, 128, 1, 1, 1))
                   for i in range(x.shape[0])])
    exp = w[:, ok].T.to(torch.bfloat16)
    assert torch.equal(y, exp), (y[y != exp][:8], exp[y != exp][:8])


def test_packed_split_k_under_cuda_graph():
    """Split-K at M = 1 and with the rows on the grid (int4, M = 3) replayed: the workspace is left zero."""
    torch.manual_seed(1)
    N, K = 4096, 14336
    t = int4_to_words(quantize(torch.randn(N, K, device="cuda") * 0.02, "int4"))
    cfg = (16, 1024, 1, 4, 3)
    for M in (1, 3):
        x = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        eager = quant_fused_linear_packed(x, "int4", t, (N, K), prologue="silu_mul", residual=r, config=cfg)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = quant_fused_linear_packed(x, "int4", t, (N, K), prologue="silu_mul", residual=r, config=cfg)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert _rel(out, eager) < 1e-3


def test_packed_qkv_rope_full_size_int4():
    """The q/k/v + RoPE kernel on the packed int4 dot, as the engine runs it (M = 1)."""
    from engine.kernels.quant_qkv_rope import quant_fused_qkv_rope_store, quant_fused_qkv_rope_store_ref
    torch.manual_seed(2)
    H, Hk, D, K, bs = 32, 8, 128, 4096, 16
    N = (H + 2 * Hk) * D
    t = int4_to_words(quantize(torch.randn(N, K, device="cuda") * 0.02, "int4"))
    cos_sin = torch.randn(64, D, device="cuda")
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nw = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    pos = torch.randint(0, 64, (1,), device="cuda")
    slots = torch.tensor([5], device="cuda")
    kc = torch.zeros(4, bs, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kr, vr = kc.float(), vc.float()
    q = quant_fused_qkv_rope_store(x, "int4", t, (N, K), None, nw, 1e-5, H, Hk, pos, cos_sin, kc, vc, slots,
                                   packed=True)
    qr = quant_fused_qkv_rope_store_ref(x.float(), "int4", t, (N, K), None, nw.float(), 1e-5, H, Hk, pos, cos_sin,
                                        kr, vr, slots)
    assert _rel(q, qr) < 1e-2, _rel(q, qr)
    assert _rel(kc, kr) < 1e-2 and _rel(vc, vr) < 1e-2


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_engine_packed_graphs_match_torch_fp32(fmt):
    """fp32, CUDA graphs, quant_gemv_packed on (int4 in the words layout: its GEMM for the prefill, the packed GEMVs
    for the decode, batches of several rows included): the torch path's greedy tokens with its log-probs, over all
    16 tokens of each request unless a near-tie of the random weights parts them."""
    from test_gpu_quant import LOGPROB_TOL_FP32, _assert_greedy_agree, _run
    ref = _run(dtype="float32", quantization=fmt, kernels="torch", enable_cuda_graphs=False, outputs=True)
    got = _run(dtype="float32", quantization=fmt, kernels="triton", fp8_activations=False,
               quant_gemv_tensor_cores=False, quant_gemv_packed=True, outputs=True)
    assert _assert_greedy_agree(ref, got, tol=LOGPROB_TOL_FP32) >= 48
