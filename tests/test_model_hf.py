"""The oracle: Hugging Face transformers on the same weights (fp32 logits within 1e-4, greedy tokens identical)."""
import pytest
import torch
import transformers

from engine import LLMEngine, SamplingParams

SMALL = dict(hidden_size=144, intermediate_size=160, num_hidden_layers=3, num_attention_heads=9,
             num_key_value_heads=3, head_dim=16, vocab_size=300, max_position_embeddings=512,
             rms_norm_eps=1e-5)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama3-rope": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "smollm2-shape": lambda: transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 4},
                                                      tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=False),
    "qwen3": lambda **kw: transformers.Qwen3Config(**{**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "hidden_size": 128, "head_dim": 32, **kw}, tie_word_embeddings=True),
}


def _hf_model(kind, folder, **overrides):
    torch.manual_seed(0)
    cfg = CONFIGS[kind](**overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # make biases and norms non-trivial so every code path matters
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_logits_match_hf(kind, tmp_path):
    hf = _hf_model(kind, tmp_path)
    eng = LLMEngine(model=str(tmp_path), device="cpu", block_size=4, max_num_batched_tokens=64,
                    num_kv_blocks=64, enable_prefix_caching=False)
    captured = []
    execute = eng.runner.execute

    def spy(input_ids, md):
        logits = execute(input_ids, md)
        captured.append(logits.clone())
        return logits
    eng.runner.execute = spy

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 23, 11)]
    for p in prompts:  # batched, unequal lengths, chunked (23 > budget share), several decode steps
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seqs = {}
    while eng.has_unfinished_requests():
        running_before = list(eng.scheduler.running) + list(eng.scheduler.waiting)
        snapshot = {s.request_id: list(s.token_ids) for s in running_before}
        sched_ids = []
        orig = eng.scheduler.schedule

        def sched_spy():
            out = orig()
            sched_ids.extend((s.request_id, s.num_tokens, start + n == s.num_tokens)
                             for s, n, start in zip(out.seqs, out.num_new_tokens, out.computed_before))
            return out
        eng.scheduler.schedule = sched_spy
        eng.step()
        eng.scheduler.schedule = orig
        rows = [(rid, snapshot[rid]) for rid, _, sampled in sched_ids if sampled]
        logits = captured.pop()
        assert logits.shape[0] == len(rows)
        with torch.no_grad():
            for (rid, toks), ours in zip(rows, logits):
                ref = hf(torch.tensor([toks])).logits[0, -1].float()
                torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
                seqs[rid] = seqs.get(rid, 0) + 1
    assert sorted(seqs.values()) == [6, 6, 6]


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a helpful math tutor."},
     {"role": "user", "content": "Explain what a prime number is."}],
]


@pytest.mark.slow
def test_bundled_smollm2_greedy_matches_hf_generate(smollm2_engine_factory):
    from engine.models.bundled import ensure_bundled
    folder = ensure_bundled()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eng = smollm2_engine_factory()
    prompts = [eng.apply_chat_template(c) for c in CHATS]
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, min_tokens=40))  # bans EOS like HF min_new_tokens
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    ours = [outs[k] for k in sorted(outs, key=lambda r: int(r.split("-")[1]))]
    for p, o in zip(prompts, ours):
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=40, do_sample=False, min_new_tokens=40)[0, ids.shape[1]:]
        assert o.token_ids == ref.tolist(), (o.text, tok.decode(ref))
    assert "Paris" in ours[0].text


@pytest.mark.slow
@pytest.mark.parametrize("fused_qk_norm", [True, False])
def test_qwen3_qk_norm_triton_matches_hf(fused_qk_norm, tmp_path):
    """Qwen3's q/k norm on the Triton path (interpreter here): in place on the qkv views (EngineConfig.fused_qk_norm)
    or copied and normalized row by row; both give HF's greedy tokens, batched and chunked. One layer: every
    kernel runs interpreted, and the norm's code is the same in each layer."""
    hf = _hf_model("qwen3", tmp_path, num_hidden_layers=1)
    eng = LLMEngine(model=str(tmp_path), device="cpu", kernels="triton", block_size=4, max_num_batched_tokens=16,
                    num_kv_blocks=64, enable_prefix_caching=False, fused_qk_norm=fused_qk_norm)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 21)]
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    ours = [outs[k] for k in sorted(outs, key=lambda r: int(r.split("-")[1]))]
    with torch.no_grad():
        for p, toks in zip(prompts, ours):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p):]
            assert toks == ref.tolist()
