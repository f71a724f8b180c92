"""kv_cache_layout="contiguous" (the max-length reservation baseline) against the paged layout, the engine's
reserved / used slot accounting, and sliding-window configs (kept within the window, or refused)."""
import pytest
import torch
import transformers

from engine import LLMEngine, SamplingParams
from helpers import drain
from inspector import figures as F

TINY = dict(model="dummy:tiny", device="cpu", block_size=8, max_model_len=64, max_num_batched_tokens=128)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompts(n, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 49152, (shared,), generator=g).tolist()
    return [head + torch.randint(0, 49152, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 30, (n,), generator=g)]


def _run(layout, prompts, num_kv_blocks=64, check=None, **cfg):
    eng = LLMEngine(**{**TINY, **cfg}, kv_cache_layout=layout, num_kv_blocks=num_kv_blocks)
    running = []

    def listen(ev):
        if getattr(ev, "kind", "") == "step":
            running.append(ev.num_running)
            if check is not None:
                check(eng, ev)
    eng.events.subscribe(listen)
    for p in prompts:
        eng.add_request(p, GREEDY)
    outs = drain(eng)
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1          # no leaked block
    return [outs[k].token_ids for k in sorted(outs, key=lambda r: int(r.split("-")[1]))], max(running), eng


@pytest.mark.slow
def test_contiguous_gives_the_paged_tokens():
    prompts = _prompts(6)
    paged, _, _ = _run("paged", prompts)
    contiguous, _, _ = _run("contiguous", prompts)
    assert contiguous == paged


@pytest.mark.slow
def test_contiguous_admits_fewer_for_the_same_memory():
    prompts = _prompts(12, seed=1)
    # 40 usable blocks of 8 slots: the contiguous layout reserves 64 / 8 = 8 blocks per request -> 5 at a time,
    # the paged one gives each request only the blocks its 3-40 tokens need
    _, paged_max, _ = _run("paged", prompts, num_kv_blocks=41)
    _, contig_max, eng = _run("contiguous", prompts, num_kv_blocks=41)
    assert contig_max == 40 // 8
    assert paged_max == 12 > contig_max


def _check_accounting(eng, ev):
    """The engine's O(1) slot counts against the block map's count from the block tables."""
    kv = eng.kv_snapshot()
    st = F.block_states(kv)
    m = ev.memory
    assert (m["reserved_slots"], m["used_slots"]) == (st["reserved_slots"], st["used_slots"])
    assert m["kv_reserved"] == m["reserved_slots"] * eng.slot_bytes and m["kv_used"] <= m["kv_reserved"]
    if eng.config.cache_config.kv_cache_layout == "contiguous":
        assert m["reserved_slots"] == len(kv["block_tables"]) * 64        # max_model_len slots each
    _check_accounting.steps += 1


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_reserved_and_used_slots_are_exact(layout):
    _check_accounting.steps = 0
    # a shared 24-token head: the paged layout shares its blocks through the prefix cache (counted once)
    _, _, eng = _run(layout, _prompts(8, seed=2, shared=24), num_kv_blocks=48, check=_check_accounting)
    assert _check_accounting.steps > 5
    if layout == "paged":
        assert eng.block_manager.total_hits > 0
    spec = F.block_map_spec(eng.kv_snapshot())
    assert "reserved by requests" in spec["layout"]["title"]["text"]


def test_memory_figure_draws_the_samples():
    _, _, eng = _run("contiguous", _prompts(4, seed=3))
    from inspector.recorder import Recorder
    rec = Recorder().attach(eng.events)
    for p in _prompts(3, seed=4):
        eng.add_request(p, GREEDY)
    drain(eng)
    spec = F.memory_spec(rec.snapshot())
    assert len(spec["data"]) == 5 and all(len(d["y"]) > 3 for d in spec["data"])
    reserved = next(d for d in spec["data"] if d["name"] == "KV reserved by requests")
    assert max(reserved["y"]) == 3 * 64 * eng.slot_bytes / 2**20


def _mistral(folder, window):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=200,
                                     max_position_embeddings=256, sliding_window=window)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.slow
def test_sliding_window_config_is_kept_within_the_window_or_refused(tmp_path):
    hf = _mistral(tmp_path, window=24)
    with pytest.raises(ValueError, match="max_model_len.*sliding_window \\(24\\)"):
        LLMEngine(model=str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=32, block_size=8)
    eng = LLMEngine(model=str(tmp_path), device="cpu", num_kv_blocks=32, block_size=8)
    assert eng.max_model_len == 24
    with pytest.raises(ValueError, match="max_model_len is 24"):
        eng.add_request(list(range(1, 30)), GREEDY)                        # longer than the window: refused
    prompt = list(range(3, 17))                                             # 14 + 10 tokens: up to the window
    rid = eng.add_request(prompt, GREEDY)
    out = drain(eng)[rid].token_ids
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    assert out == ref


def test_qwen2_window_applies_only_when_used():
    from engine.models.config import ModelArchConfig
    base = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=100, sliding_window=32)
    assert ModelArchConfig.from_hf(base).sliding_window is None
    assert ModelArchConfig.from_hf({**base, "use_sliding_window": True}).sliding_window == 32
    assert ModelArchConfig.from_hf({**base, "layer_types": ["full_attention", "sliding_attention"]}).sliding_window == 32
