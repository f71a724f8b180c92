"""FP8 KV cache (kv_cache_dtype="fp8"): the store kernels write e4m3 codes, the attention kernels read them.

CPU: Triton kernels under the interpreter at small odd shapes; GPU (TRITON_INTERPRET=0 and CUDA): bf16 too.
"""
import pytest
import torch

from engine.kernels import torch_ops
from engine.kernels import triton_ops as tk
from engine.kernels.paged_attention_ref import paged_attention_decode_ref, paged_attention_ref
from kernel_helpers import DEV, DTYPES, TOL, make_batch, qkv_views, rand, rel_err

FP8 = torch.float8_e4m3fn


def _codes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def test_kv_encode_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([1000.0, -1000.0, 448.0, 31.5125, 0.0, -0.0, 1e-8, 0.0025, 1.0625, 1.1875])
    got = torch_ops.kv_encode(x, FP8).float()
    # 31.51 rounds up across an exponent (32), 1.0625 / 1.1875 are ties (to even: 1.0 and 1.25), 2^-9 steps below 2^-6
    want = torch.tensor([448.0, -448.0, 448.0, 32.0, 0.0, 0.0, 0.0, 0.001953125, 1.0, 1.25])
    assert torch.equal(got, want)
    assert torch_ops.kv_encode(x, torch.float32) is x


def _slots(T, nblocks, bs, pad):
    slots = (torch.randperm((nblocks - 1) * bs, device=DEV)[:T] + bs).long()   # never the null block
    slots[pad] = -1
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_fp8_matches_torch(dtype):
    T, Hk, D, bs, nb = 11, 3, 24, 4, 9
    k, v = (rand(T, Hk, D, dtype=dtype) * 40 for _ in range(2))     # beyond +-448 too: saturated
    slots = _slots(T, nb, bs, pad=[2, 7])
    caches = [torch.zeros(nb, bs, Hk, D, dtype=FP8, device=DEV) for _ in range(4)]
    tk.store_kvcache(k, v, caches[0], caches[1], slots)
    torch_ops.store_kvcache(k, v, caches[2], caches[3], slots)
    assert torch.equal(_codes(caches[0]), _codes(caches[2])) and torch.equal(_codes(caches[1]), _codes(caches[3]))
    assert _codes(caches[0]).any()
    keep = slots >= 0
    got = caches[0].view(-1, Hk, D)[slots[keep]].float()
    assert torch.equal(got, k[keep].float().clamp(-448, 448).to(FP8).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_codes_keep_the_sign_of_values_that_round_to_zero(dtype):
    """Values below half the smallest subnormal (2^-10) become a signed zero, -0.0 as 0x80, as torch's cast gives;
    subnormals and normals either side of them too."""
    vals = torch.tensor([-1e-5, 1e-5, -0.0, 0.0, -9e-4, 9e-4, -3e-3, 3e-3, -0.02, 0.02, -300.0, 300.0])
    T, Hk, D, bs, nb = 3, 1, 4, 4, 2
    k = vals.view(T, Hk, D).to(device=DEV, dtype=dtype)
    v = -k
    slots = torch.tensor([4, 5, 6], device=DEV)
    caches = [torch.zeros(nb, bs, Hk, D, dtype=FP8, device=DEV) for _ in range(4)]
    tk.store_kvcache(k, v, caches[0], caches[1], slots)
    torch_ops.store_kvcache(k, v, caches[2], caches[3], slots)
    assert torch.equal(_codes(caches[0]), _codes(caches[2])) and torch.equal(_codes(caches[1]), _codes(caches[3]))
    codes = _codes(caches[0]).view(-1)[4 * D:7 * D]
    assert codes[0] == 0x80 and codes[1] == 0x00 and codes[2] == 0x80 and codes[3] == 0x00


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store_fp8_matches_torch(dtype):
    T, H, Hk, D, bs, nb = 7, 6, 3, 16, 4, 6
    q, k, v = qkv_views(T, H, Hk, D, dtype)
    cos_sin = rand(64, D)
    pos = torch.randint(0, 64, (T,), device=DEV)
    slots = _slots(T, nb, bs, pad=[3])
    caches = [torch.zeros(nb, bs, Hk, D, dtype=FP8, device=DEV) for _ in range(4)]
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    tk.rope_and_store(q1, k1, v, pos, cos_sin, caches[0], caches[1], slots)
    torch_ops.rope_and_store(q2, k2, v, pos, cos_sin, caches[2], caches[3], slots)
    assert torch.equal(_codes(caches[1]), _codes(caches[3]))                   # v: no arithmetic before the code
    # k: rotated in fp32 by both, rounding may differ by an ulp of k's dtype, rarely a code
    differ = (_codes(caches[0]) != _codes(caches[2])).float().mean().item()
    assert differ < 0.02
    assert rel_err(caches[0].float(), caches[2].float()) < 0.07


def test_fused_qkv_rope_store_fp8_matches_torch():
    M, H, Hk, D, K, bs, nb = 3, 6, 2, 16, 40, 4, 4
    x, w = rand(M, K), rand((H + 2 * Hk) * D, K) * 0.3
    nw, cos_sin = rand(K), rand(32, D)
    pos, slots = torch.tensor([5, 9, 31], device=DEV), _slots(M, nb, bs, pad=[])
    caches = [torch.zeros(nb, bs, Hk, D, dtype=FP8, device=DEV) for _ in range(4)]
    q1 = tk.fused_qkv_rope_store(x, w, None, nw, 1e-6, H, Hk, pos, cos_sin, caches[0], caches[1], slots)
    q2 = torch_ops.fused_qkv_rope_store(x, w, None, nw, 1e-6, H, Hk, pos, cos_sin, caches[2], caches[3], slots)
    assert rel_err(q1, q2) < 1e-4
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert (_codes(a) != _codes(b)).float().mean().item() < 0.02               # a GEMV's rounding vs torch's
        assert rel_err(a.float(), b.float()) < 0.07


def _fp8_batch(q_lens, seq_lens, dtype, bs=4, H=9, Hk=3, D=32):
    q, kc, vc, md = make_batch(q_lens, seq_lens, H=H, Hk=Hk, D=D, bs=bs, dtype=torch.float32)
    return q.to(dtype), (kc * 3).to(FP8), (vc * 3).to(FP8), md      # unused slots stay NaN (e4m3fn has NaN)


FP8_CASES = {"mixed": ([1, 23, 1, 9, 1], [70, 23, 5, 41, 1]), "chunk": ([11], [50]), "prefill": ([37], [37])}


@pytest.mark.parametrize("dtype, case", [(d, "mixed") for d in DTYPES] + [(torch.float32, "chunk"),
                                                                          (torch.float32, "prefill")])
def test_paged_attention_fp8_cache(dtype, case):
    q, kc, vc, md = _fp8_batch(*FP8_CASES[case], dtype)
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_ref(q.double(), kc, vc, md, scale)              # the codes upcast exactly
    out = torch.full(q.shape, float("nan"), device=DEV, dtype=dtype)
    tk.paged_attention(q, kc, vc, md, scale, out=out)
    assert rel_err(out, ref) < TOL[dtype]
    # the torch path masks the tails of its gathered blocks after the product: give it finite garbage there
    kc, vc = (c.float().nan_to_num(7.0).to(FP8) for c in (kc, vc))
    assert rel_err(torch_ops.paged_attention(q, kc, vc, md, scale), ref) < TOL[dtype]


@pytest.mark.parametrize("case", ["mixed", "chunk", "prefill"])
def test_paged_attention_fp8_cache_f16_dot(case):
    """bf16 queries against fp8 codes, the prefill kernel's products in fp16 (its default for an fp8 cache)."""
    q, kc, vc, md = _fp8_batch(*FP8_CASES[case], torch.bfloat16)
    scale = q.shape[-1] ** -0.5
    out = tk.paged_attention(q, kc, vc, md, scale, config={"f16_dot": True})
    ref = paged_attention_ref(q.double(), kc, vc, md, scale)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("splits, dtype, f16_dot", [(1, torch.float32, False), (4, torch.float32, False),
                                                    (1, torch.bfloat16, True), (4, torch.bfloat16, True)])
def test_paged_attention_decode_fp8_cache(splits, dtype, f16_dot):
    """f16_dot: bf16 queries against fp8 codes with the products in fp16 (a launch config of the kernel)."""
    q, kc, vc, md = _fp8_batch([1] * 4, [1, 130, 7, 64], dtype, bs=16)
    scale = q.shape[-1] ** -0.5
    out = tk.paged_attention_decode(q, kc, vc, md.block_tables, md.seq_lens, scale, md.max_seqlen_k,
                                    num_splits=splits, config={"f16_dot": f16_dot})
    ref = paged_attention_decode_ref(q.double(), kc, vc, md.block_tables, md.seq_lens, scale)
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]


# ---------------------------------------------------------------- the engine with an fp8 pool

def _tiny(**cfg):
    from engine import LLMEngine
    cfg = {"device": "cpu", "kernels": "torch", "cpu_kv_cache_gib": 0.01, "block_size": 4, **cfg}
    return LLMEngine(model="dummy:tiny", **cfg)


def _greedy(eng, n=4, max_tokens=12):
    from engine import SamplingParams
    from helpers import run_requests
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, eng.arch_config.vocab_size, (9 + 7 * i,), generator=g).tolist() for i in range(n)]
    prompts[1][:8] = prompts[0][:8]                          # a shared two-block prefix
    outs = run_requests(eng, prompts, [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * n)
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
    return [o.token_ids for o in outs]


def test_fp8_pool_holds_the_bytes_of_its_codes():
    from engine.config import EngineConfig
    from engine.core.sizing import derive_num_blocks
    from engine.models.config import ModelArchConfig
    from engine.models.presets import preset_config
    from engine.worker.model_runner import kv_bytes_per_block, kv_cache_dtype
    mcfg = ModelArchConfig.from_hf(preset_config("tiny"))
    cpu = torch.device("cpu")
    blocks = {}
    for kv in ("auto", "fp8"):
        cfg = EngineConfig(model="dummy:tiny", kv_cache_dtype=kv, cpu_kv_cache_gib=0.01, block_size=16)
        dt = kv_cache_dtype(cfg, torch.bfloat16)
        assert dt == (FP8 if kv == "fp8" else torch.bfloat16)
        blocks[kv] = derive_num_blocks(cfg, mcfg, cpu, torch.bfloat16)
        assert blocks[kv] == int(0.01 * 2**30) // kv_bytes_per_block(mcfg, 16, dt)
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)      # the same bytes, twice the blocks


@pytest.mark.slow
def test_fp8_engine_same_tokens_under_chunking_prefix_cache_and_preemption():
    ref = _greedy(_tiny(kv_cache_dtype="fp8", enable_prefix_caching=False, max_num_batched_tokens=256))
    chunked = _tiny(kv_cache_dtype="fp8", max_num_batched_tokens=8)          # chunks, prefix hits
    assert chunked.runner.kv_cache.dtype == FP8 and chunked.slot_bytes * 4 == _tiny().slot_bytes
    assert _greedy(chunked) == ref
    assert chunked.block_manager.total_hits > 0
    tight = _tiny(kv_cache_dtype="fp8", num_kv_blocks=12, enable_prefix_caching=False)
    assert _greedy(tight) == ref
    assert tight.scheduler.num_preemptions > 0
    spec = _tiny(kv_cache_dtype="fp8", enable_prefix_caching=False, speculative_method="ngram")
    assert _greedy(spec) == ref
    assert spec.drafter.total_stats()["spec_decode_num_draft_tokens"] > 0
