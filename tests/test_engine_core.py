"""Engine-core requirements not covered elsewhere: loader (sharded safetensors, never pickles),
preset shapes, bundled tokenizer check, KV pool sizing, scheduler policy (victim, static batches, mixed
prefill+decode forward), the event stream contract, the LLM API, UTF-8-safe detokenization."""
import json

import pytest
import torch
import transformers

from engine import LLM, LLMEngine, SamplingParams
from engine.runtime import step_events
from engine.runtime.detokenizer import Detokenizer, check_stop_strings, streamable_len
from engine.events import RequestEvent, StepEvent
from engine.kernels.ops import get_ops
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.presets import preset_config
from engine.core.sequence import Sequence
from helpers import drain


# ---------------------------------------------------------------- loader and presets
@pytest.mark.slow
def test_sharded_safetensors_load_like_single_file_and_pickles_are_refused(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    single, sharded, pickled = tmp_path / "single", tmp_path / "sharded", tmp_path / "pickled"
    hf.save_pretrained(single, safe_serialization=True)
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)

    prompt = [5, 17, 42, 7, 99, 3, 250, 11]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 8:].tolist()
    for folder in (single, sharded):
        eng = LLMEngine(model=str(folder), device="cpu", num_kv_blocks=32, block_size=4)
        eng.add_request(prompt, sp)
        (out,) = drain(eng).values()
        assert out.token_ids == ref, folder.name

    pickled.mkdir()
    (pickled / "config.json").write_text((single / "config.json").read_text())
    torch.save(hf.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*\.safetensors .* never pickles"):
        LLMEngine(model=str(pickled), device="cpu")


@pytest.mark.parametrize("name, params_b, heads", [
    ("smollm2-135m", 0.135, (9, 3)), ("llama-3.2-1b", 1.236, (32, 8)),
    ("llama-3.1-8b", 8.030, (32, 8)), ("qwen3-0.6b", 0.596, (16, 8)),
])
def test_presets_have_the_real_shapes(name, params_b, heads):
    cfg = ModelArchConfig.from_hf(preset_config(name))
    with torch.device("meta"):                        # shapes only: no memory
        model = LlamaForCausalLM(cfg, get_ops("torch"), max_pos=1)
    n = sum(p.numel() for p in model.parameters())
    if cfg.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        n -= model.lm_head.weight.numel()             # tied at load time: one matrix
    assert abs(n / 1e9 - params_b) / params_b < 0.01, n
    assert (cfg.num_heads, cfg.num_kv_heads) == heads
    assert cfg.qk_norm == (name.startswith("qwen3"))


@pytest.mark.slow
def test_bundled_tokenizer_known_ids():
    from engine.models.bundled import check_tokenizer, ensure_bundled, gguf_path
    tok = transformers.AutoTokenizer.from_pretrained(str(ensure_bundled()))
    check_tokenizer(tok, gguf_path())                 # special ids + GGUF vocabulary spot checks
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids.count(2) >= 1          # <|im_start|> ... <|im_end|>
    assert tok.decode(tok("The capital of France is Paris.", add_special_tokens=False).input_ids) == \
        "The capital of France is Paris."

    class Broken:
        def convert_tokens_to_ids(self, t):
            return 5
    with pytest.raises(RuntimeError, match="<|endoftext|>"):
        check_tokenizer(Broken())


def test_kv_pool_sized_from_the_cpu_memory_budget():
    eng = LLMEngine(model="dummy:tiny", device="cpu", cpu_kv_cache_gib=0.01, block_size=16)
    per_block = 2 * 2 * 16 * 2 * 16 * 4             # k+v, layers, block, kv heads, head_dim, fp32
    assert eng.num_blocks == int(0.01 * (1 << 30)) // per_block
    eng2 = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=40)
    assert eng2.num_blocks == 40 and eng2.block_manager.num_free_blocks == 39   # block 0 is the null block


# ---------------------------------------------------------------- scheduler policy
@pytest.mark.slow
def test_preemption_victim_is_most_recently_admitted_and_rejoins_the_front():
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=13, block_size=4, max_num_seqs=2,
                    enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    a = eng.add_request(list(range(10, 18)), sp)
    b = eng.add_request(list(range(20, 28)), sp)
    c = eng.add_request(list(range(30, 38)), sp)       # waits: max_num_seqs=2
    events = []
    eng.events.subscribe(events.append)
    first = None
    while eng.has_unfinished_requests():
        eng.step()
        pre = [e for e in events if isinstance(e, StepEvent) and e.preempted]
        if pre and first is None:
            first = pre[0].preempted
            assert first == [b]                                    # last admitted, not a
            assert [s.request_id for s in eng.scheduler.waiting][:2] == [b, c]   # front of the queue
            assert [s.request_id for s in eng.scheduler.running] == [a]
    assert first is not None
    kinds = [e.kind for e in events if isinstance(e, RequestEvent) and e.request_id == b]
    assert "preempted" in kinds and kinds[-1] == "finished"


@pytest.mark.parametrize("steps", [1, 4])
def test_static_batch_runs_until_all_finish(steps):
    # steps=4: multi-step decode blocks, which must not admit the newcomer by a mixed step either
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, scheduling="static", max_num_seqs=4,
                    num_scheduler_steps=steps)
    a = eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    b = eng.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(e))
    drain(eng)
    ids = [{s.request_id for s in e.scheduled} for e in steps]
    a_done = next(i for i, e in enumerate(steps) if a in e.finished)
    assert all(b not in s for s in ids[:a_done + 1]) and b in ids[a_done + 1]
    # continuous: b joins the running batch at once
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_num_seqs=4)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    b = eng.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    assert b in {s.request_id for s in eng.scheduler.running}


def test_chunked_prefill_and_decodes_share_one_forward():
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    calls = []
    execute = eng.runner.execute

    def spy(input_ids, md):
        calls.append(int(input_ids.numel()))
        return execute(input_ids, md)
    eng.runner.execute = spy
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(e))
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()
    eng.add_request(list(range(100, 130)), SamplingParams(max_tokens=2, ignore_eos=True))   # 30 tokens: chunks
    drain(eng)
    assert len(calls) == len(steps)                                  # one forward per step
    mixed = [e for e in steps if {s.phase for s in e.scheduled} == {"prefill", "decode"}]
    assert len(mixed) >= 3
    for e in steps:
        assert e.num_prefill_tokens + e.num_decode_tokens <= 8
    for e, n in zip(steps, calls):
        assert n == e.num_prefill_tokens + e.num_decode_tokens     # packed: no padding
    chunks = [s.num_tokens for e in steps for s in e.scheduled if s.phase == "prefill" and s.total_len == 30]
    assert sum(chunks) == 30 and len(chunks) >= 4


# ---------------------------------------------------------------- event stream
def test_event_stream_contract():
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                    enable_prefix_caching=False)
    events = []
    eng.events.subscribe(events.append)
    a = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=5, ignore_eos=True))
    b = eng.add_request(list(range(40, 45)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request(b)
    drain(eng)
    steps = [e for e in events if isinstance(e, StepEvent)]
    reqs = [e for e in events if isinstance(e, RequestEvent)]
    assert [e.step for e in steps] == list(range(steps[0].step, steps[0].step + len(steps)))   # one per step
    for e in steps:
        assert e.start <= e.end and 0.0 <= e.kv_usage <= 1.0 and e.num_blocks == 64
        assert e.num_prefill_tokens + e.num_decode_tokens == sum(s.num_tokens for s in e.scheduled)
        assert {"schedule", "forward", "sampling", "embedding", "attention", "mlp", "norms"} <= set(e.timings)
        assert all(v >= 0 for v in e.timings.values())
        json.dumps(e.to_dict())
    assert steps[0].scheduled[0].phase == "prefill" and steps[0].scheduled[0].num_tokens == 16   # a's 1st chunk
    assert any(s.phase == "decode" for e in steps for s in e.scheduled)
    allocated = sum(len(e.blocks_allocated) for e in steps)
    assert allocated > 0 and allocated == sum(len(e.blocks_freed) for e in steps)    # every block came back
    assert [a] == [r for e in steps for r in e.finished]
    assert steps[-1].num_running == 0 and steps[-1].num_waiting == 0 and steps[-1].kv_usage == 0.0
    kinds = {rid: [e.kind for e in reqs if e.request_id == rid] for rid in (a, b)}
    assert kinds[a] == ["arrived", "scheduled", "first_token", "finished"]
    assert kinds[b][0] == "arrived" and kinds[b][-1] == "aborted"
    fin = next(e for e in reqs if e.kind == "finished")
    assert fin.output_len == 5 and fin.finish_reason == "length" and fin.prompt_len == 20


def test_no_listener_builds_no_records(monkeypatch):
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64)

    def boom(*a, **k):
        raise AssertionError("event built with no listener")
    monkeypatch.setattr(step_events, "StepEvent", boom)
    monkeypatch.setattr(step_events, "RequestEvent", boom)
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(drain(eng)[rid].token_ids) == 4
    got = []
    eng.events.subscribe(got.append)                   # a listener that raises never breaks the engine
    eng.events.subscribe(lambda e: 1 / 0)
    monkeypatch.undo()
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(drain(eng)[rid].token_ids) == 4 and got


# ---------------------------------------------------------------- LLM API
@pytest.mark.slow
def test_llm_generate_chat_stream():
    llm = LLM("dummy:tiny", device="cpu", num_kv_blocks=128)
    prompts = [[5, 6, 7], "hello there", [9] * 20]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 7, 5]             # in input order
    assert outs[0].prompt_token_ids == [5, 6, 7] and outs[1].prompt_token_ids == llm.tokenizer("hello there").input_ids
    for o in outs:
        m = o.metrics
        assert o.finish_reason == "length" and m.arrival_time <= m.first_token_time <= m.finished_time
        assert o.ttft > 0 and m.num_preemptions == 0
    with pytest.raises(ValueError, match="sampling_params: got 2 for 3 prompts"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        llm.generate(["ok", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()                  # validated before anything was added
    conv = [{"role": "user", "content": "Hi"}]
    (c,) = llm.chat(conv, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert c.prompt_token_ids == llm.engine.tokenizer(llm.engine.apply_chat_template(conv),
                                                      add_special_tokens=False).input_ids
    chunks = list(llm.stream([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)))
    assert sum((ch.delta_token_ids for ch in chunks), []) == chunks[-1].token_ids and len(chunks[-1].token_ids) == 6
    assert chunks[-1].finished and not any(ch.finished for ch in chunks[:-1])
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert llm.generate([[5, 6]], seeded, use_tqdm=False)[0].token_ids == \
        llm.generate([[5, 6]], seeded, use_tqdm=False)[0].token_ids


# ---------------------------------------------------------------- detokenization
@pytest.fixture(scope="module")
def tok():
    from engine.models.bundled import ensure_bundled
    return transformers.AutoTokenizer.from_pretrained(str(ensure_bundled()))


def _stream(tok, ids, params, prompt=(1,)):
    seq = Sequence("r", None, list(prompt), params, 0.0)
    det = Detokenizer(tok)
    det.start(seq)
    pieces, stop = [], None
    for t in ids:
        seq.append_token(t)
        new = det.update(seq)
        pieces.append(new)
        stop = check_stop_strings(seq, new)
        if stop:
            break
    return seq, pieces, stop


def test_incremental_detokenization_is_utf8_safe(tok):
    text = "Café 世界 🙂 naïve — ok"
    ids = tok(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tok.decode([t]) for t in ids)              # some character spans several tokens
    seq, pieces, _ = _stream(tok, ids, SamplingParams())
    assert "".join(pieces) == seq.text == text
    assert all("\ufffd" not in p for p in pieces)


def test_tokens_that_add_no_text_do_not_grow_the_decode_window(tok):
    """A long run of skipped special tokens (a dummy-weight model's favourite) or of bytes that never form a
    character leaves at most 4 tokens held back, so each token decodes a window of bounded length; the text is
    what decoding the whole output gives."""
    from engine.runtime import detokenizer
    calls = []
    for ids, skip in (([tok.all_special_ids[0]] * 200, True), ([tok.convert_tokens_to_ids("Ã")] * 200, True)):
        seq = Sequence("r", None, [1, 2, 3], SamplingParams(skip_special_tokens=skip), 0.0)
        det = detokenizer.Detokenizer(tok)
        decode = det._decode
        det._decode = lambda window, skip, decode=decode: calls.append(len(window)) or decode(window, skip)
        det.start(seq)
        for t in ids:
            seq.append_token(t)
            det.update(seq)
            assert seq.num_tokens - seq.read_offset <= detokenizer._MAX_PENDING
        assert max(calls) <= 2 * detokenizer._MAX_PENDING + 6
        whole = tok.decode(ids, skip_special_tokens=skip)
        assert seq.text.replace("\ufffd", "") == whole.replace("\ufffd", "")


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_rust_path_matches_transformers_decode(tok, skip):
    """The fast path (the Rust tokenizer behind the HF one) streams exactly the text transformers' decode
    gives, on random ids that include special tokens and pieces of multi-byte characters."""
    import random
    rng = random.Random(7)
    special = list(tok.all_special_ids)
    for trial in range(40):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 9))]
        fast = _stream(tok, ids, SamplingParams(skip_special_tokens=skip), prompt)[0]
        seq = Sequence("r", None, list(prompt), SamplingParams(skip_special_tokens=skip), 0.0)
        det = Detokenizer(tok)
        assert det._rust is not None
        det._rust = None                                   # transformers' decode
        det.start(seq)
        for t in ids:
            seq.append_token(t)
            det.update(seq)
        assert fast.text == seq.text, (trial, ids)


def test_stop_string_spanning_tokens(tok):
    ids = tok("Hello world, this is a test", add_special_tokens=False).input_ids
    first = tok.decode(ids[:1])
    assert first == "Hello" and tok.decode(ids[1:2]) == " world"
    params = SamplingParams(stop=["o wor"])
    seq, pieces, stop = _stream(tok, ids[:1], params)
    assert stop is None and streamable_len(seq) == len("Hell")        # "o" held back: it may start the stop
    seq, pieces, stop = _stream(tok, ids, params)
    assert stop == "o wor" and seq.text == "Hell" and len(pieces) == 2   # matched across the token boundary


def test_skip_tokenizer_init_serves_token_ids_without_text():
    """skip_tokenizer_init (vLLM's): no tokenizer is loaded; token-id prompts give the same greedy tokens as with
    one and no text; a text prompt is refused naming the field."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_tok = LLMEngine(model=None, device="cpu", cpu_kv_cache_gib=0.1)
    prompt = with_tok.tokenize("The capital of France is")
    ref = drain_one(with_tok, prompt, params)
    eng = LLMEngine(model=None, device="cpu", cpu_kv_cache_gib=0.1, skip_tokenizer_init=True)
    assert eng.tokenizer is None
    out = drain_one(eng, prompt, params)
    assert out.token_ids == ref.token_ids and ref.text and out.text == ""
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("The capital of France is", params)


def drain_one(eng, prompt, params):
    rid = eng.add_request(prompt, params)
    return drain(eng)[rid]


def test_detokenize_false_gives_token_ids_without_text():
    eng = LLMEngine(model=None, device="cpu", cpu_kv_cache_gib=0.1)
    prompt = eng.tokenize("The capital of France is")
    ref = drain_one(eng, prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    out = drain_one(eng, prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False))
    assert out.token_ids == ref.token_ids and ref.text and out.text == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["."])
