"""The C++ CPU kernels (engine/kernels/cpu_kernels.py) against their torch implementations: kvscope::decode_attention
(torch_ops.decode_attention_ref) at odd lengths, scattered blocks, GQA, skipped slots, cache dtypes; kvscope::int4_linear
(torch_ops.int4_linear_ref) at odd sizes; kvscope::decode_layer (torch_ops.decode_layer_ref) at odd sizes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_kernels, torch_ops

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ CPU kernel could not be built")
ROOT = Path(__file__).resolve().parents[1]


def make_case(B: int, Hk: int, g: int, D: int, lens: list[int], dtype, cache_dtype, seed: int):
    """Caches with random contents, each sequence's blocks scattered over the pool, this step's token at
    position len - 1 (every third sequence's slot -1: not stored)."""
    gen = torch.Generator().manual_seed(seed)
    bs = 16
    nbs = [-(-n // bs) for n in lens]
    N = sum(nbs) + 3
    perm = torch.randperm(N - 1, generator=gen) + 1                  # block 0 stays the null block
    width = max(nbs) + 2
    tables = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for b, nb in enumerate(nbs):
        tables[b, :nb] = perm[at:at + nb].int()
        at += nb
    k_cache = (torch.randn(N, bs, Hk, D, generator=gen) * 2).to(cache_dtype)
    v_cache = torch.randn(N, bs, Hk, D, generator=gen).to(cache_dtype)
    qkv = torch.randn(B, (g + 2) * Hk * D, generator=gen).to(dtype)  # q, k, v as views of one projection
    q, k, v = qkv.split([g * Hk * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(B, g * Hk, D), k.view(B, Hk, D), v.view(B, Hk, D)
    pos = torch.tensor(lens) - 1
    slots = tables[torch.arange(B), pos // bs].long() * bs + pos % bs
    slots[::3] = -1
    return q, k, v, k_cache, v_cache, slots, tables, torch.tensor(lens, dtype=torch.int32)


CASES = [  # B, Hk, g, D, lens
    (1, 3, 3, 64, [1]),
    (1, 2, 1, 32, [37]),
    (5, 3, 3, 64, [17, 1, 130, 16, 45]),
    (5, 1, 1, 24, [3, 33, 5, 64, 7]),
    (5, 2, 3, 40, [250, 9, 31, 2, 16]),
]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@needs_kernel
@pytest.mark.parametrize("B,Hk,g,D,lens", CASES)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.float32, torch.float8_e4m3fn),
                                               (torch.bfloat16, torch.float8_e4m3fn)])
def test_cpp_kernel_matches_torch(B, Hk, g, D, lens, dtype, cache_dtype):
    args = make_case(B, Hk, g, D, lens, dtype, cache_dtype, seed=B * 100 + D)
    q, k, v, kc, vc, slots, tables, seq_lens = args
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = torch_ops.decode_attention_ref(q.clone(), k, v, kc_ref, vc_ref, slots, tables, seq_lens, D ** -0.5)
    out = torch.ops.kvscope.decode_attention(q, k, v, kc, vc, slots, tables, seq_lens, D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))      # the same codes stored, slot -1 skipped
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernel
def test_fp8_store_saturates():
    """An fp8 cache stores values beyond e4m3's range as +-448, as torch_ops.kv_encode does."""
    q, k, v, kc, vc, slots, tables, seq_lens = make_case(2, 1, 2, 16, [5, 20], torch.float32, torch.float8_e4m3fn, 7)
    k = k * 1000
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_ops.decode_attention_ref(q, k, v, kc_ref, vc_ref, slots, tables, seq_lens, 1.0)
    torch.ops.kvscope.decode_attention(q, k, v, kc, vc, slots, tables, seq_lens, 1.0)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert kc.float().abs().max() == 448


@needs_kernel
def test_store_only_rows_and_attention_only():
    """No tokens to store (the eager path's decode: the KV already stored) leaves the caches as they were."""
    q, k, v, kc, vc, slots, tables, seq_lens = make_case(3, 2, 2, 32, [40, 3, 17], torch.float32, torch.float32, 3)
    before = kc.clone(), vc.clone()
    empty = k[:0]
    out = torch.ops.kvscope.decode_attention(q, empty, empty, kc, vc, slots[:0], tables, seq_lens, 0.2)
    ref = torch_ops.decode_attention_ref(q, empty, empty, kc, vc, slots[:0], tables, seq_lens, 0.2)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("lens", [[700], [600, 3], [1030, 257, 40]])
def test_long_contexts_split_over_threads(lens):
    """With more threads than sequences a long context splits into ranges whose partial softmaxes merge (a range
    may be empty for a short sequence of the batch)."""
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        q, k, v, kc, vc, slots, tables, seq_lens = make_case(len(lens), 3, 3, 64, lens, torch.float32, torch.float32, 5)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        ref = torch_ops.decode_attention_ref(q, k, v, kc_ref, vc_ref, slots, tables, seq_lens, 0.125)
        out = torch.ops.kvscope.decode_attention(q, k, v, kc, vc, slots, tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_rejects_slots_and_lengths_beyond_the_pool():
    """A slot past the pool or a length past the block table raises instead of writing or reading outside."""
    q, k, v, kc, vc, slots, tables, seq_lens = make_case(2, 1, 2, 16, [5, 20], torch.float32, torch.float32, 2)
    bad = slots.clone()
    bad[1] = kc.shape[0] * kc.shape[1]
    with pytest.raises(RuntimeError, match="slot"):
        torch.ops.kvscope.decode_attention(q, k, v, kc, vc, bad, tables, seq_lens, 1.0)
    long = seq_lens.clone()
    long[0] = tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="seq_lens"):
        torch.ops.kvscope.decode_attention(q, k, v, kc, vc, slots, tables, long, 1.0)



def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the values kvscope::int4_linear multiplies: each 32-block rounded (to nearest even) to int8
    codes q1 of d = max|x| / 127, and the remainder to int8 codes q2 of d / 256: d q1 + d / 256 q2."""
    M, K = x.shape
    g = x.float().view(M, K // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)     # true division (127 / t: a reciprocal)
    d = amax / torch.full_like(amax, 127)
    q1 = torch.round(g * inv)
    q2 = torch.round(((g - d * q1) * (inv * 256)).clamp(-127, 127))
    return (d * q1 + d / 256 * q2).view(M, K)


@needs_kernel
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 6, 9, 21])                # 6: a zero-padded group of 8 rows; 9, 21: groups + tiles
def test_int4_linear_against_the_dequantized_weight(M, dtype, G):
    """x @ w.T for w dequantized from kvscope's int4 format (N = 75: not a multiple of the kernel's row tiles).
    With x replaced by its rounded values the product is the same up to fp32 summation order; against x itself
    the error is bounded by the rounding, |x - (d q1 + d / 256 q2)| <= d / 256 a value: sum_k |w_k| d_k / 256."""
    from engine.quant import formats
    gen = torch.Generator().manual_seed(M * G)
    N, K = 75, 384
    t = formats.quantize(torch.randn(N, K, generator=gen), "int4", G)
    x = (torch.randn(M, K, generator=gen) * torch.rand(M, K, generator=gen) * 4).to(dtype)
    x[0, :32] = 0                                                           # a block of zeros: d = 0
    out = torch.ops.kvscope.int4_linear(x, t["qweight"], t["scales"], t["mins"], G)
    assert out.dtype == dtype and out.shape == (M, N)
    w = formats.dequantize("int4", t, (N, K))                               # [N, K] fp32
    xf = x.float()
    ref, ref_q = xf @ w.T, int8_activations(xf) @ w.T
    out_slack = 2 ** -8 * ref_q.abs() if dtype == torch.bfloat16 else 0     # the bf16 output's rounding
    assert ((out.float() - ref_q).abs() <= 1e-5 * (xf.abs() @ w.abs().T) + out_slack + 1e-6).all()
    d = xf.view(M, K // 32, 32).abs().amax(-1) / 127                        # [M, blocks]
    bound = (d.repeat_interleave(32, 1) / 256) @ w.abs().T                  # [M, N]
    assert ((out.float() - ref).abs() <= bound * 1.001 + out_slack + 1e-4).all()
    assert torch.equal(torch_ops.int4_linear_ref(x, t["qweight"], t["scales"], t["mins"], G), (xf @ w.T).to(dtype))


@needs_kernel
def test_int4_linear_rejects_mismatched_shapes():
    from engine.quant import formats
    t = formats.quantize(torch.randn(16, 64), "int4", 32)
    with pytest.raises(RuntimeError, match="qweight"):
        torch.ops.kvscope.int4_linear(torch.randn(2, 96), t["qweight"], t["scales"], t["mins"], 32)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.kvscope.int4_linear(torch.randn(2, 64), t["qweight"], t["scales"], t["mins"], 64)

def make_layer_case(B: int, E: int, H: int, Hk: int, D: int, I: int, lens: list[int], G: int, scale_dtype,
                    bias: bool, seed: int):
    """kvscope::decode_layer's arguments: random int4 projections (scales and mins in scale_dtype), norms, rotary
    table, caches and residual rows; this step's token of sequence b at position lens[b] - 1."""
    from engine.quant import formats
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for N, K in (((H + 2 * Hk) * D, E), (E, H * D), (2 * I, E), (E, I)):
        t = formats.quantize(torch.randn(N, K, generator=gen) / K ** 0.5, "int4", G)
        weights += [t["qweight"], t["scales"].to(scale_dtype), t["mins"].to(scale_dtype)]
    _, _, _, kc, vc, slots, tables, seq_lens = make_case(B, Hk, H // Hk, D, lens, torch.float32, torch.float32, seed)
    qkv_bias = torch.randn((H + 2 * Hk) * D, generator=gen) if bias else None
    norms = [torch.rand(E, generator=gen) + 0.5 for _ in range(2)]
    cos_sin = torch.cat([torch.cos(a := torch.rand(400, D // 2, generator=gen) * 6), torch.sin(a)], dim=-1)
    h = torch.randn(B, E, generator=gen) * 3
    return (h, weights, qkv_bias, *norms, 1e-5, cos_sin, seq_lens.long() - 1, kc, vc, slots, tables, seq_lens, H,
            D ** -0.5)


LAYER_CASES = [  # B, hidden, H, Hk, D, intermediate, lens, group, scales' dtype, q/k/v bias
    (1, 96, 6, 2, 32, 160, [37], 32, torch.float16, False),
    (3, 128, 4, 1, 40, 192, [17, 1, 130], 32, torch.float32, True),
    (3, 64, 3, 3, 64, 128, [16, 33, 250], 64, torch.float16, False),
    (8, 96, 6, 2, 32, 160, [5, 40, 17, 1, 99, 16, 33, 64], 32, torch.float16, True),
    (7, 128, 4, 1, 48, 192, [3, 18, 77, 9, 130, 2, 31], 64, torch.float32, False),
]


@needs_kernel
@pytest.mark.parametrize("B,E,H,Hk,D,I,lens,G,scale_dtype,bias", LAYER_CASES)
def test_decode_layer_matches_torch(B, E, H, Hk, D, I, lens, G, scale_dtype, bias):
    """One decoder layer's decode step in C++ against its torch composition (the same int4 GEMM and attention
    kernels, the norms, RoPE, SiLU-and-mul and residual adds in torch): the output rows and the K/V stored."""
    args = make_layer_case(B, E, H, Hk, D, I, lens, G, scale_dtype, bias, seed=B * 10 + D)
    kc, vc = args[8], args[9]                                               # written in place
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = torch_ops.decode_layer_ref(*args[:8], kc_ref, vc_ref, *args[10:])
    out = torch.ops.kvscope.decode_layer(*args)
    assert out.shape == ref.shape == (B, E) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kc, kc_ref, atol=1e-5, rtol=1e-5)          # K rotated (RoPE), V as projected
    torch.testing.assert_close(vc, vc_ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_decode_layer_rejects_mismatched_shapes():
    args = list(make_layer_case(1, 96, 6, 2, 32, 160, [5], 32, torch.float16, False, seed=1))
    with pytest.raises(RuntimeError, match="weights"):
        torch.ops.kvscope.decode_layer(*args[:1], args[1][:9], *args[2:])
    args[13] = 4                                                            # 4 heads: the weights are for 6
    with pytest.raises(RuntimeError, match="o_proj"):
        torch.ops.kvscope.decode_layer(*args)


FALLBACK = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from engine.kernels import cpu_kernels, torch_ops
from tests.test_cpu_kernels import make_case
assert cpu_kernels.load() is None
q, k, v, kc, vc, slots, tables, lens = make_case(2, 1, 3, 16, [5, 20], torch.float32, torch.float32, 1)
kc2, vc2 = kc.clone(), vc.clone()
out = torch.ops.kvscope.decode_attention(q, k, v, kc, vc, slots, tables, lens, 0.25)
ref = torch_ops.decode_attention_ref(q, k, v, kc2, vc2, slots, tables, lens, 0.25)
assert torch.equal(out, ref) and torch.equal(kc, kc2)
torch.ops.kvscope.decode_attention(q, k, v, kc, vc, slots, tables, lens, 0.25)
from engine.quant import formats
t = formats.quantize(torch.randn(24, 64), "int4", 32)
x = torch.randn(3, 64)
out = torch.ops.kvscope.int4_linear(x, t["qweight"], t["scales"], t["mins"], 32)
assert torch.equal(out, torch_ops.int4_linear_ref(x, t["qweight"], t["scales"], t["mins"], 32))
from tests.test_cpu_kernels import make_layer_case
args = make_layer_case(2, 64, 2, 1, 32, 64, [5, 20], 32, torch.float16, True, 2)
ref = torch_ops.decode_layer_ref(*args[:8], args[8].clone(), args[9].clone(), *args[10:])
assert torch.equal(torch.ops.kvscope.decode_layer(*args), ref)
print("ok")
"""


def test_falls_back_to_torch_without_a_toolchain(tmp_path):
    """No ninja or compiler on PATH: the op runs its torch implementation, and one warning says so."""
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = subprocess.run([sys.executable, "-c", FALLBACK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr.count("using the torch implementation") == 1, out.stderr


BACKGROUND = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
llm = LLM("dummy:tiny", device="cpu", cpu_kv_cache_gib=0.01, max_model_len=64)
build = cpu_kernels._state["build"]          # not built here: the engine started a background build
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
first = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
assert build.wait(timeout=300) != 0             # no toolchain on PATH: the build fails
again = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids   # the next step's poll finds it
assert not cpu_kernels.loaded() and "module" in cpu_kernels._state and first == again, (first, again)
print("ok")
"""


def test_engine_never_waits_for_the_build(tmp_path):
    """An engine on a machine without the built kernel starts a background build and serves with the torch
    implementation meanwhile; a failed build leaves it serving, with one warning."""
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = subprocess.run([sys.executable, "-c", BACKGROUND], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "in the background" in out.stderr and out.stderr.count("build failed") == 1, out.stderr
