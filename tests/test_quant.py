"""Quantized weights: formats, the Triton kernels against their torch references (interpreter, odd sizes),
pre-quantized checkpoints in the published layouts, and the bundled SmolLM2 under each format."""

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.quant_gemm import quant_matmul, quant_matmul_ref
from engine.kernels.quant_gemv import quant_fused_linear, quant_fused_linear_ref
from engine.quant.formats import BLOCK, FORMATS, dequantize, quantize
from engine.quant.linear import QuantLinear, weight_bytes
from helpers import every_code_weight, random_llama_weights, write_checkpoint

# relative Frobenius error of quantize -> dequantize on N(0, 1) weights (measured 0.027 / 0.007 / 0.098)
ROUND_TRIP_BOUND = {"fp8": 0.035, "int8": 0.01, "int4": 0.12}


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_bound(fmt):
    """Relative error on N(0, 1) weights, and every weight within half a grid step."""
    torch.manual_seed(0)
    w = torch.randn(257, 389)
    t = quantize(w, fmt)
    err = float((dequantize(fmt, t, w.shape) - w).norm() / w.norm())
    assert err < ROUND_TRIP_BOUND[fmt], err
    assert err > ROUND_TRIP_BOUND[fmt] / 10            # it did quantize
    # every weight is within half a step of the grid: int8 scale/2, int4 scale/2, fp8 2^-4 relative (+ subnormals)
    d = dequantize(fmt, t, w.shape)
    if fmt == "int8":
        assert bool(((d - w).abs() <= t["weight_scale"] / 2 + 1e-6).all())
    if fmt == "int4":
        step = t["scales"].float().repeat_interleave(BLOCK, 1)[:, :w.shape[1]]
        assert bool(((d - w).abs() <= step / 2 + 1e-3).all())


def test_int4_layout_nibbles():
    """Byte i of a group holds k = i (low nibble) and k = 64 + i (high nibble)."""
    N, K = 2, 200                                        # two groups, the second partial
    codes = torch.randint(0, 16, (N, 256), dtype=torch.uint8)
    g = codes.view(N, 2, 128)
    packed = (g[..., :64] | (g[..., 64:] << 4)).reshape(N, 128)
    t = {"qweight": packed, "scales": torch.ones(N, 2, dtype=torch.float16),
         "mins": torch.full((N, 2), -8.0, dtype=torch.float16)}
    assert torch.equal(dequantize("int4", t, (N, K)), codes[:, :K].float() - 8)
    w = codes[:, :K].float() - 8
    assert torch.equal(dequantize("int4", quantize(w, "int4"), (N, K)), w)   # integers 0..15 - 8 are exact


@pytest.mark.slow
@pytest.mark.parametrize("fmt,group", [("fp8", 128), ("int8", 128), ("int4", 128), ("int4", 32)])
@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
def test_quant_gemv_matches_reference(fmt, group, prologue):
    """The decodes (CVT 1: bit operations, 0: conversion instructions, int8's 2: a multiply-add) and both loop
    orders (PRE 1: next tile prefetched), M = 1 and a padded M = 3; N over one 128-row fp8 scale block, K not a
    multiple of 128 (BLOCK_N 32 and 64: programs on both sides of the scale block's edge)."""
    torch.manual_seed(1)
    N, K = 133, 333
    t = quantize(torch.randn(N, K) * 0.05, fmt, group)
    bk = 128 if fmt == "int4" else 64
    cvt = 2 if fmt == "int8" else 0                                  # int8's third decode
    for M, dtype, cfg in ((1, torch.float32, (32, bk, 1, 1, 1)), (3, torch.float16, (64, 2 * bk, 1, cvt, 0))):
        x = torch.randn(M, 2 * K if prologue == "silu_mul" else K).to(dtype)
        kw = dict(prologue=prologue, norm_weight=(torch.rand(K) + 0.5).to(dtype), eps=1e-5,
                  residual=torch.randn(M, N).to(dtype))
        bias = torch.randn(N).to(dtype)
        y = quant_fused_linear(x, fmt, t, (N, K), bias, config=cfg, **kw)
        ref = quant_fused_linear_ref(x, fmt, t, (N, K), bias, **kw)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_gemv_decodes_every_code_exactly(fmt):
    """One-hot activation rows read the weight back column by column: each decode (CVT) gives every code's exact
    value, as the torch reference dequantizes it."""
    N, K = 16, 256
    t = every_code_weight(fmt, N, K)
    w = dequantize(fmt, t, (N, K))
    cols = [0, 1, 2, 63, 64, 65, 127, 128, 200, 255]
    x = torch.eye(K)[cols]                                             # [M = 10, K] one-hot rows, fp32
    for cvt in (0, 1, 2) if fmt == "int8" else (0, 1):
        y = quant_fused_linear(x, fmt, t, (N, K), config=(8, 256, 1, cvt, 1))
        assert torch.equal(y, w[:, cols].T), (fmt, cvt)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,group", [("fp8", 128), ("int8", 128), ("int4", 32)])
def test_quant_qkv_rope_store_matches_reference(fmt, group):
    """The quantized q/k/v linear with RoPE and the KV store in its epilogue vs dequantize + the torch
    composition: q, and the caches (a padding slot stores nothing); fp8's 160 rows span two scale blocks."""
    from engine.kernels.quant_qkv_rope import quant_fused_qkv_rope_store, quant_fused_qkv_rope_store_ref
    torch.manual_seed(4)
    (H, Hk, D), K, bs = ((3, 1, 32) if fmt == "fp8" else (2, 1, 16)), 200, 4
    N = (H + 2 * Hk) * D
    t = quantize(torch.randn(N, K) * 0.05, fmt, group)
    cos_sin = torch.randn(64, D)
    for M, dtype, bias, cfg in ((1, torch.float32, False, (4, 128, 1, 1, 1)), (3, torch.float16, True, None)):
        x = torch.randn(M, K).to(dtype)
        nw = (torch.rand(K) + 0.5).to(dtype)
        b = torch.randn(N).to(dtype) if bias else None
        positions = torch.randint(0, 64, (M,))
        slots = torch.tensor([5, -1, 9][:M])
        kc, vc = torch.randn(4, bs, Hk, D).to(dtype), torch.randn(4, bs, Hk, D).to(dtype)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q = quant_fused_qkv_rope_store(x, fmt, t, (N, K), b, nw, 1e-5, H, Hk, positions, cos_sin, kc, vc, slots,
                                       config=cfg)
        q_ref = quant_fused_qkv_rope_store_ref(x, fmt, t, (N, K), b, nw, 1e-5, H, Hk, positions, cos_sin, kc_ref,
                                               vc_ref, slots)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(q.float(), q_ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(kc.float(), kc_ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(vc.float(), vc_ref.float(), atol=tol, rtol=tol)


def test_quant_gemv_config_table():
    """Launch configs: the swept table's entry for a known shape, the rule otherwise; BLOCK_K shrinks with M."""
    from engine.kernels.quant_gemv import QUANT_GEMV_CONFIGS, quant_gemv_config
    for (fmt, N, K), cfg in QUANT_GEMV_CONFIGS.items():
        assert quant_gemv_config(fmt, 1, N, K) == cfg
        assert fmt == "int8" or fmt == "int4" or 128 % cfg[0] == 0        # fp8 rows stay in one scale block
    bn, bk, warps, cvt, pre = quant_gemv_config("int8", 1, 999, 333)     # unknown shape: the rule
    assert bk <= 512 and warps >= 1 and cvt in (0, 1) and pre in (0, 1)
    assert quant_gemv_config("int8", 16, 6144, 4096)[1] < quant_gemv_config("int8", 1, 6144, 4096)[1]


@pytest.mark.parametrize("fmt,group", [("fp8", 128), ("int8", 128), ("int4", 128), ("int4", 64)])
def test_quant_gemm_matches_reference(fmt, group):
    torch.manual_seed(2)
    M, N, K = 37, 75, 333
    t = quantize(torch.randn(N, K) * 0.05, fmt, group)
    for dtype in (torch.float32, torch.float16):
        x, bias = torch.randn(M, K).to(dtype), torch.randn(N).to(dtype)
        y = quant_matmul(x, fmt, t, (N, K), bias, config=(16, 32, 4, 1))
        ref = quant_matmul_ref(x, fmt, t, (N, K), bias)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)
    # fp8 activations (w8a8): the interpreter rounds fp32 -> fp8 wrongly at binade edges; tests/test_gpu_engine.py


def test_config_validates_quantization():
    with pytest.raises(ValueError, match="EngineConfig.quantization"):
        EngineConfig(quantization="int3")


# ---- pre-quantized checkpoints in the published layouts ------------------------------------------------
# q, k, v and gate, up rows are multiples of 128 (as in Qwen3-8B), so fp8 block scales concatenate
TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=160, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=300, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
W8A8_CONFIG = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
               "ignore": ["lm_head"], "config_groups": {"group_0": {
                   "targets": ["Linear"],
                   "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                               "dynamic": False},
                   "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                         "dynamic": True}}}}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def _published(fmt, float_w):
    """Float weights -> the published pre-quantized tensors (per HF projection, unfused)."""
    out = {}
    for name, w in float_w.items():
        if not any(f".{p}." in name for p in PROJ):
            out[name] = w.to(torch.bfloat16)
            continue
        t = quantize(w, fmt)
        out[name] = t["weight"]
        if fmt == "fp8":
            out[name + "_scale_inv"] = t["weight_scale_inv"]            # fp32 [N/128, K/128]
        else:
            out[name + "_scale"] = t["weight_scale"].to(torch.bfloat16)  # [N, 1]
            out[name + "_zero_point"] = torch.zeros(w.shape[0], 1, dtype=torch.int8)
    return out


def _logits(eng, ids):
    """Every position's logits for one prompt (a prefill through the runner)."""
    n, bs = len(ids), eng.block_size
    nb = -(-n // bs)
    md = AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(bs, bs + n),
                           cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                           seq_lens=torch.tensor([n], dtype=torch.int32),
                           block_tables=torch.arange(1, nb + 1, dtype=torch.int32)[None],
                           logits_indices=torch.arange(n), q_lens=[n], seq_lens_cpu=[n], max_seqlen_q=n,
                           max_seqlen_k=n, block_size=bs)
    return eng.runner.execute(torch.tensor(ids), md)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,qcfg", [("fp8", FP8_CONFIG), ("int8", W8A8_CONFIG)])
def test_prequantized_checkpoint_matches_on_load_quantization(tmp_path, fmt, qcfg):
    float_w = random_llama_weights(TINY)
    write_checkpoint(tmp_path / "float", TINY, {k: v.to(torch.bfloat16) for k, v in float_w.items()})
    write_checkpoint(tmp_path / "pre", {**TINY, "quantization_config": qcfg},
           _published(fmt, {k: v.to(torch.bfloat16).float() for k, v in float_w.items()}))
    common = dict(device="cpu", kernels="torch", num_kv_blocks=8, max_model_len=64, dtype="bfloat16")
    pre = LLMEngine(model=str(tmp_path / "pre"), **common)          # detected from quantization_config
    onload = LLMEngine(model=str(tmp_path / "float"), quantization=fmt, **common)
    assert pre.quantization == onload.quantization == fmt
    for a, b in zip(pre.model.model.layers, onload.model.model.layers):
        for name in ("qkv_proj", "o_proj"):
            qa, qb = getattr(a.self_attn, name), getattr(b.self_attn, name)
            assert isinstance(qa, QuantLinear) and qa.fmt == fmt
            for k, v in qb.tensors().items():
                torch.testing.assert_close(qa.tensors()[k].float(), v.float(), rtol=1e-2, atol=0)
    ids = list(range(3, 40))
    torch.testing.assert_close(_logits(pre, ids), _logits(onload, ids), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="EngineConfig.quantization"):
        LLMEngine(model=str(tmp_path / "pre"), quantization="int4", **common)


def _attach_cache(model, num_blocks=8, bs=16):
    c = model.cfg
    kv = torch.zeros(2, c.num_layers, num_blocks, bs, c.num_kv_heads, c.head_dim, dtype=model.cos_sin.dtype)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0, i], kv[1, i]


def _md(start, n, bs=16):
    """One sequence computing positions [start, start + n), blocks 1, 2, ...; logits for every position."""
    end = start + n
    return AttentionMetadata(positions=torch.arange(start, end), slot_mapping=torch.arange(bs + start, bs + end),
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([end], dtype=torch.int32),
                             block_tables=torch.arange(1, -(-end // bs) + 1, dtype=torch.int32)[None],
                             logits_indices=torch.arange(n), q_lens=[n], seq_lens_cpu=[end], max_seqlen_q=n,
                             max_seqlen_k=end, block_size=bs)


@torch.inference_mode()
def _prefill_then_decode(model, ids):
    """Logits of a prefill of ids[:-1] (the GEMM path) and of a one-token decode of ids[-1] (the fused GEMV)."""
    _attach_cache(model)
    n = len(ids) - 1
    pre = model.compute_logits(model(torch.tensor(ids[:-1]), _md(0, n)))
    model.gemv_max_tokens = 1
    dec = model.compute_logits(model(torch.tensor(ids[-1:]), _md(n, 1)))
    return pre, dec


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_quantized_model_triton_matches_torch(fmt):
    """Inside the model the Triton kernels (GEMM for a prefill; for a decode step the fused GEMVs with their
    prologues and residual, q/k/v with RoPE and the KV store in its epilogue) give the torch path's logits."""
    from engine.kernels.ops import get_ops
    from engine.models.loader import build_model
    cfg = {**TINY, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 1, "num_key_value_heads": 1,
           "head_dim": 32}
    out = [_prefill_then_decode(build_model(cfg, None, get_ops(k), torch.device("cpu"), torch.float32, max_pos=64,
                                            seed=5, quantization=fmt), [5, 9, 13, 200, 7, 11, 3])
           for k in ("torch", "triton")]
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_weight_bytes_shrink():
    from engine.kernels.ops import get_ops
    from engine.models.loader import build_model
    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512}
    sizes = {}
    for fmt in (None, "int8", "int4"):
        model = build_model(cfg, None, get_ops("torch"), torch.device("cpu"), torch.bfloat16, max_pos=32, seed=0,
                            quantization=fmt)
        wb = weight_bytes(model)
        sizes[fmt] = sum(sum(d.values()) for d in wb["per_layer"])
        assert wb["total"] == sum(wb["by_dtype"].values())
    assert sizes["int8"] < 0.55 * sizes[None] and sizes["int4"] < 0.6 * sizes["int8"]


# ---- the bundled SmolLM2 under each format -------------------------------------------------------------
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press. Within fifty years, printers in more than two "
        "hundred European cities had produced millions of books, and the cost of knowledge fell sharply.")
# mean KL(float || quantized) of next-token distributions over TEXT and top-1 agreement; measured (54 positions):
# int8 0.0045 / 0.963, fp8 0.0174 / 0.889, int4 g128 0.568 / 0.574. The bundled weights are a dequantized Q4_1
# GGUF (4-bit, groups of 32): int4 with 128-groups cannot hold that grid, int4 with 32-groups reproduces it.
KL_BOUND = {("int8", 128): 0.01, ("fp8", 128): 0.03, ("int4", 128): 0.7}
TOP1_MIN = {("int8", 128): 0.92, ("fp8", 128): 0.85, ("int4", 128): 0.5}


@pytest.fixture(scope="module")
def smollm2_reference():
    from engine.kernels.ops import get_ops
    from engine.models.loader import build_model, load_tokenizer, resolve
    hf_cfg, folder, tok = resolve(None)
    model = build_model(hf_cfg, folder, get_ops("torch"), torch.device("cpu"), torch.float32, max_pos=128, seed=0)
    ids = load_tokenizer(tok).encode(TEXT, add_special_tokens=False)
    return model, ids, _prefill_then_decode(model, ids)[0].log_softmax(-1)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,group", list(KL_BOUND))
def test_smollm2_quantized_kl_and_top1(fmt, group, smollm2_reference):
    """Next-token distributions over a fixed text: mean KL to the float model and top-1 (greedy) agreement."""
    import copy

    from engine.quant.linear import quantize_model
    model, ids, ref = smollm2_reference
    qmodel = copy.deepcopy(model)
    quantize_model(qmodel, fmt, "torch", group=group)
    lp = _prefill_then_decode(qmodel, ids)[0].log_softmax(-1)
    kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == lp.argmax(-1)).float().mean())
    print(f"\n{fmt} (group {group}): mean KL {kl:.5f}, top-1 agreement {top1:.3f} over {len(ids) - 1} positions")
    assert 0 < kl < KL_BOUND[fmt, group] and top1 >= TOP1_MIN[fmt, group]


def test_weights_figure_sums_to_the_model():
    from engine.kernels.ops import get_ops
    from engine.models.loader import build_model
    from inspector.figures import as_figure, weights_spec
    model = build_model({**TINY, "tie_word_embeddings": True}, None, get_ops("torch"), torch.device("cpu"),
                        torch.bfloat16, max_pos=32, seed=0, quantization="int4")
    wb = weight_bytes(model)
    spec = weights_spec(wb, "int4")
    bars = {t["name"]: sum(t["y"]) for t in spec["data"]}
    assert set(bars) == {"bfloat16", "float16", "uint8 (int4 codes)"}
    assert abs(sum(bars.values()) * 2**20 - wb["total"]) < 1
    assert len(spec["data"][0]["x"]) == TINY["num_hidden_layers"] + 1 and "int4" in spec["layout"]["title"]["text"]
    as_figure(spec)                                          # a valid plotly figure


def test_int4_group32_reproduces_the_bundled_q4_1_grid(smollm2_reference):
    """The bundled weights came from a Q4_1 GGUF (4-bit, min + scale per 32 weights): int4 with 32-groups holds
    them exactly (so its KL is 0), 128-groups cannot."""
    model = smollm2_reference[0]
    w = model.model.layers[3].mlp.down_proj.weight.detach()                  # [576, 1536]
    err = {g: float((dequantize("int4", quantize(w, "int4", g), w.shape) - w).abs().max() / w.abs().max())
           for g in (32, 128)}
    assert err[32] < 2e-3 and err[128] > 0.02, err

