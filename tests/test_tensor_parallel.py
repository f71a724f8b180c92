"""Tensor parallelism on CPU (gloo, one worker process per extra rank): the same greedy tokens as one rank in
fp32 under chunked prefill, preemption and prefix caching; shards that add up to the full weights; a killed
worker fails the in-flight requests with a clear error; no process stays behind."""
import os
import signal
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runtime.async_engine import EngineLoop
from helpers import drain, random_llama_weights, write_checkpoint
from engine.distributed.parallel_state import TensorParallel
from engine.kernels.ops import get_ops
from engine.distributed.sharding import shard_layout
from engine.models.config import ModelArchConfig
from engine.models.loader import build_model, resolve
from engine.models.presets import preset_config
from inspector.figures.parallel import parallel_spec
from inspector.figures.timings import timings_spec
from inspector.recorder import Recorder

CHATS = ["What is the capital of France?", "Count from one to ten in words, separated by commas, please."]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[i].token_ids for i in ids]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is gone but not yet reaped
        return f.read().split(")")[1].split()[0] != "Z"


def wait_gone(pids, timeout=60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def full_and_shards(model: str, size: int):
    hf, weights, _ = resolve(model)
    args = (hf, weights, get_ops("torch"), torch.device("cpu"), torch.float32, 64, 0)
    full = build_model(*args)
    return full, [build_model(*args, tp=TensorParallel(r, size, "gloo")) for r in range(size)]


def test_uneven_heads_split_by_kv_group():
    """SmolLM2's 9 heads / 3 KV heads over 2 ranks: 6 + 3 query heads, 2 + 1 KV heads (its weights are read
    by these slices in test_smollm2_tp2_same_greedy_tokens)."""
    cfg = ModelArchConfig.from_hf(preset_config("smollm2-135m"))
    lays = [shard_layout(cfg, 2, r) for r in range(2)]
    assert [(x.q_start, x.num_heads, x.kv_start, x.num_kv_heads) for x in lays] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert [(x.i_start, x.intermediate, x.v_start, x.vocab) for x in lays] == [(0, 768, 0, 24576),
                                                                               (768, 768, 24576, 24576)]
    eight = [shard_layout(ModelArchConfig.from_hf(preset_config("llama-3.1-8b")), 16, r) for r in (0, 1, 15)]
    assert [(x.q_start, x.num_heads, x.kv_start) for x in eight] == [(0, 2, 0), (2, 2, 0), (30, 2, 7)]  # replicated


def test_shards_add_up_to_the_full_model():
    """Every rank draws exactly its slice of the random weights: concatenated, the shards are the one-rank
    weights (the vocabulary tail padded with zero rows)."""
    full, shards = full_and_shards("dummy:tiny", 2)
    cfg, D = full.cfg, full.cfg.head_dim
    for name, p in full.named_parameters():
        ps = [dict(s.named_parameters())[name] for s in shards]
        if "o_proj" in name or "down_proj" in name:                 # row-parallel: input columns split
            cat = torch.cat(ps, 1)
        elif "qkv_proj" in name:                                     # [q | k | v] rows of each rank
            parts = [q.split([s.cfg.num_heads * D, s.cfg.num_kv_heads * D, s.cfg.num_kv_heads * D])
                     for s, q in zip(shards, ps)]
            cat = torch.cat([torch.cat([pt[i] for pt in parts]) for i in range(3)])
        elif "gate_up" in name:
            i = shards[0].cfg.intermediate_size
            cat = torch.cat([torch.cat([q[:i] for q in ps]), torch.cat([q[i:] for q in ps])])
        elif "embed_tokens" in name or "lm_head" in name:           # vocab rows, the tail padded with zeros
            cat = torch.cat(ps)
            assert not cat[cfg.vocab_size:].any()
            cat = cat[:cfg.vocab_size]
        else:                                                        # norms: replicated
            assert all(torch.equal(q, p) for q in ps), name
            continue
        assert torch.equal(cat, p), name


def test_layout_errors_name_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(tensor_parallel_size=2, speculative_method="self")
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks cannot share 2 KV heads"):
        LLMEngine(model="dummy:tiny", device="cpu", tensor_parallel_size=4)   # refused before any process starts


@pytest.fixture(scope="module")
def chats():
    from engine.models.loader import load_tokenizer
    tok = load_tokenizer(resolve(None)[2])
    return [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
            for c in CHATS]


@pytest.mark.slow
def test_smollm2_tp2_same_greedy_tokens(smollm2_engine_factory, chats):
    """Chunks of 24 tokens, a pool of 7 blocks (preemption), a repeated prompt (prefix cache hits), decode
    steps through the fused linears (residual added by rank 0 alone)."""
    prompts = chats + [chats[1]]
    cfg = dict(dtype="float32", max_num_batched_tokens=24, num_kv_blocks=7, gemv_max_tokens=4)
    ref = run(smollm2_engine_factory(**cfg), prompts, GREEDY)
    eng = smollm2_engine_factory(tensor_parallel_size=2, **cfg)
    try:
        pids = eng.executor.pids
        out = run(eng, prompts, GREEDY)
        assert eng.scheduler.num_preemptions > 0
        assert eng.block_manager.total_hits > 0
        assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
        assert eng.stats()["parallel_layout"] == "TP=2 · gloo · cpu"
    finally:
        eng.close()
    assert out == ref
    assert len({tuple(o) for o in ref}) == len(chats)
    assert wait_gone(pids), "a worker process outlived LLMEngine.close()"


@pytest.mark.slow
def test_tiny_tp2_multi_step_and_rank_timings():
    """Multi-step decode feeds the workers tokens sampled on rank 0; observed steps carry each rank's
    forward regions with an all_reduce region."""
    prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(20 + 9 * i)] for i in range(4)]
    cfg = dict(model="dummy:tiny", device="cpu", dtype="float32", num_scheduler_steps=4,
               max_num_batched_tokens=32)
    ref = run(LLMEngine(**cfg), prompts, GREEDY)
    eng = LLMEngine(tensor_parallel_size=2, **cfg)
    rec = Recorder().attach(eng.events)
    try:
        out = run(eng, prompts, GREEDY)
        info = eng.parallel_info()                  # the inspector's parallel view
    finally:
        eng.close()
    assert [(r["q_heads"], r["kv_heads"], r["intermediate"]) for r in info["ranks"]] == \
        [([0, 3], [0, 1], [0, 64]), ([3, 3], [1, 1], [64, 64])]
    assert info["ranks"][1]["weight_bytes"] > 0 and info["ranks"][1]["kv_pool_bytes"] == info["ranks"][0]["kv_pool_bytes"]
    cells = parallel_spec(info)["data"][0]["cells"]["values"]
    assert cells[3] == ["0–0 (1)", "1–1 (1)"]
    assert out == ref
    steps = rec.snapshot().steps
    launched = [s for s in steps if "attention" in s.timings]    # (the last block's step launches no forward)
    assert any(s.num_decode_steps > 1 for s in launched)
    assert all(s.timings.get("all_reduce", 0) > 0 for s in launched)
    assert all(s.rank_timings and s.rank_timings[1].get("all_reduce", 0) > 0 for s in steps)
    fig = timings_spec(rec.snapshot())
    names = {t.get("name") for t in fig["data"]}
    assert {"all_reduce", "rank 0 model", "rank 1 model", "rank 1 all-reduce + gather"} <= names


@pytest.mark.slow
def test_killed_worker_fails_requests_clearly_and_leaves_no_process():
    loop = EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", dtype="float32", tensor_parallel_size=2,
                                   max_num_batched_tokens=8))
    loop.start()
    try:
        (pid,) = loop.engine.executor.pids
        stream = loop.submit(list(range(10, 60)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        next(iter(stream))                               # it runs
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            for _ in stream:
                pass
        with pytest.raises(RuntimeError, match="restart the engine"):   # the next request fails at once too
            for _ in loop.submit([5, 6, 7], SamplingParams(max_tokens=4)):
                pass
    finally:
        loop.shutdown()
        loop.engine.close()
    assert wait_gone([pid])
    assert not torch.distributed.is_initialized()       # a new tensor-parallel engine can start in this process


# a shape whose shards start on fp8's 128 x 128 blocks and int4's 128-groups (as the 8B shape's do at TP=2)
ALIGNED = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=512, rms_norm_eps=1e-5,
               rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
               eos_token_id=2)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_shards_are_slices_of_the_quantized_model(fmt):
    """Each rank quantizes its own shard: fp8 blocks and int4 groups (packing and scales) come out as the
    slices of the whole model's, so TP=2 computes with the same weights as TP=1."""
    args = (ALIGNED, None, get_ops("torch"), torch.device("cpu"), torch.float32, 64, 0)
    full = build_model(*args, quantization=fmt)
    shards = [build_model(*args, tp=TensorParallel(r, 2, "gloo"), quantization=fmt) for r in range(2)]
    D = full.cfg.head_dim
    for i, layer in enumerate(full.model.layers):
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            get = lambda m: m.model.layers[i].get_submodule(path)          # noqa: E731
            assert get(full).fmt == fmt
            w, ws = get(full).dequantize(torch.float32), [get(s).dequantize(torch.float32) for s in shards]
            if path.endswith(("o_proj", "down_proj")):
                cat = torch.cat(ws, 1)
            elif path.endswith("qkv_proj"):
                parts = [x.split([s.cfg.num_heads * D, s.cfg.num_kv_heads * D, s.cfg.num_kv_heads * D])
                         for s, x in zip(shards, ws)]
                cat = torch.cat([torch.cat([pt[j] for pt in parts]) for j in range(3)])
            else:
                n = shards[0].cfg.intermediate_size
                cat = torch.cat([torch.cat([x[:n] for x in ws]), torch.cat([x[n:] for x in ws])])
            assert torch.equal(cat, w), (fmt, path)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_tp2_quantized_shards_with_ngram_drafts_same_tokens_and_logprobs(fmt, tmp_path):
    """Each rank quantizes its slice of a float checkpoint (int8's row-parallel shards take the whole row's scale,
    |max| reduced over the ranks); n-gram drafts are proposed on rank 0 and verified by a forward every rank runs.
    TP=2 gives TP=1's greedy tokens and their logprobs. int4 on the CPU: TP=1's LM head is int4 with its top
    candidates rescored (RescoredLMHead), so its logprobs are normalized over int4 logits in the tail, where TP=2's
    vocabulary shards stay float."""
    hf = dict(ALIGNED, num_hidden_layers=2, tie_word_embeddings=False)      # tied, the last token repeats
    model = str(write_checkpoint(tmp_path, hf, random_llama_weights(hf)))
    prompts = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13] * 3, [(5 * j) % 300 + 20 for j in range(40)]]
    cfg = dict(model=model, device="cpu", dtype="float32", quantization=fmt, speculative_method="ngram",
               speculative_auto_off=False, num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = []
    for tp in (1, 2):
        eng = LLMEngine(tensor_parallel_size=tp, **cfg)
        try:
            ids = [eng.add_request(p, params) for p in prompts]
            done = drain(eng)
            st = eng.stats()
        finally:
            eng.close()
        assert st["quantization"] == fmt and st["spec_decode_num_draft_tokens"] > 0
        outs.append([(done[i].token_ids, [lp[0].logprob for lp in done[i].logprobs]) for i in ids])
    (ref, out) = outs
    assert [t for t, _ in out] == [t for t, _ in ref]
    assert all(len(set(t)) > 3 for t, _ in ref)                 # tokens that could differ
    for (_, a), (_, b) in zip(out, ref):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=5e-2 if fmt == "int4" else 1e-4), fmt


def test_prequantized_checkpoint_refused_with_tp_naming_the_field(tmp_path):
    hf = dict(ALIGNED, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    from safetensors.torch import save_file
    save_file({"model.norm.weight": torch.ones(256)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="EngineConfig.quantization: a pre-quantized checkpoint cannot be split"):
        build_model(hf, tmp_path, get_ops("torch"), torch.device("cpu"), torch.float32, 64, 0,
                    tp=TensorParallel(0, 2, "gloo"))
