"""Speculative decoding beside the multi-step pipeline: auto-off's shadow probes (EngineConfig.spec_shadow_probes)
keep requests whose drafting is off inside multi-step blocks, and long drafts (num_speculative_tokens_max) grow
a request's draft after a draft accepted whole. Greedy output stays token-identical to plain decoding."""
import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.worker.multi_step import MultiStepDecoder
from engine.config import EngineConfig
from engine.worker.cuda_graphs import CudaGraphRunner
from engine.events import StepEvent
from engine.spec.base import Drafter
from helpers import SPEC_VOCAB, check_no_leak, drain

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=96, num_kv_blocks=400,
            max_num_batched_tokens=256)
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)


def test_config_validation():
    with pytest.raises(ValueError, match="spec_shadow_probes"):
        EngineConfig(spec_shadow_probes="yes")
    with pytest.raises(ValueError, match="spec_shadow_every_block"):
        EngineConfig(spec_shadow_every_block=1)
    with pytest.raises(ValueError, match="spec_shadow_confirm"):
        EngineConfig(spec_shadow_confirm=0)
    with pytest.raises(ValueError, match="spec_prefetch"):
        EngineConfig(spec_prefetch=None)
    with pytest.raises(ValueError, match="num_speculative_tokens_max"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=4, num_speculative_tokens_max=3)
    with pytest.raises(ValueError, match="num_speculative_tokens_max"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=4, num_speculative_tokens_max=17)
    with pytest.raises(ValueError, match="num_speculative_tokens_max"):
        EngineConfig(speculative_method="self", num_speculative_tokens=2, num_speculative_tokens_max=4)
    cfg = EngineConfig(speculative_method="ngram", num_speculative_tokens=4, num_speculative_tokens_max=8)
    assert cfg.speculative_config.max_speculative_tokens == 8
    assert EngineConfig().speculative_config.max_speculative_tokens == 0
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=4).speculative_config.max_speculative_tokens == 4


def _run(target, prompts, sp, monkeypatch=None, **cfg):
    """-> (token ids per request, stats, step events, cold block launches)"""
    eng = LLMEngine(model=target, **dict(BASE, **cfg))
    events, cold = [], [0]
    eng.events.subscribe(events.append)
    if monkeypatch is not None:
        # auto-off's decisions without this machine's step timings (a GPU-like verify / iteration cost ratio)
        monkeypatch.setattr(Drafter, "cost_ratio", lambda self, batch, k: 1.6)
        launch = MultiStepDecoder.launch

        def counted(self, K, ahead=None, sample=True):
            if ahead is None:
                cold[0] += 1
            return launch(self, K, ahead, sample)
        monkeypatch.setattr(MultiStepDecoder, "launch", counted)
    for p in prompts:
        eng.add_request(p, sp)
    outs = drain(eng)
    check_no_leak(eng)
    steps = [e for e in events if isinstance(e, StepEvent)]
    return [outs[k].token_ids for k in sorted(outs)], eng.stats(), steps, cold[0]


def test_shadow_probes_keep_drafting_off_requests_in_multi_step_blocks(spec_models, monkeypatch):
    """Random text sampled at temperature 1 (n-gram drafts would almost never be accepted): with shadow probes,
    after the first probes every decode step is a multi-step block, the pipeline is started once and never
    drained for a probe, and the probes still happened (in the shadow). Without them, each due probe drains
    the pipeline."""
    rng = random.Random(4)
    prompts = [[rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(8, 20))] for _ in range(4)]
    sp = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    got, st, steps, cold = _run(spec_models["target"], prompts, sp, monkeypatch, num_scheduler_steps=4, **NGRAM)
    assert [len(o) for o in got] == [64] * 4
    assert st["spec_shadow_probes"] > 0
    verify = [i for i, e in enumerate(steps) if e.spec and e.spec["num_draft_tokens"]]
    first_block = next(i for i, e in enumerate(steps) if e.num_decode_steps > 1)
    assert all(i < first_block for i in verify)                       # only the first probes verified
    decode_after = [e for e in steps[first_block:] if e.num_decode_tokens]
    assert decode_after and all(e.num_decode_steps > 1 for e in decode_after)
    assert cold == 1
    _, st_old, _, cold_old = _run(spec_models["target"], prompts, sp, monkeypatch, num_scheduler_steps=4,
                                  spec_shadow_probes=False, **NGRAM)
    assert st_old["spec_shadow_probes"] == 0
    assert cold_old > cold + 2                                        # real probes drain the pipeline


def test_shadow_probes_turn_drafting_back_on_and_stay_lossless(spec_models, monkeypatch):
    """Greedy under multi-step, one request at a time: random prompts, on which the random model falls into loops
    that n-gram drafts predict. Drafting that went off inside blocks comes back on from a shadow probe (a verify
    step for a request after it ran in a block), and the output equals plain decoding's."""
    rng = random.Random(9)
    sp = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    back_on = 0
    for _ in range(3):
        prompt = [rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(6, 16))]
        ref, _, _, _ = _run(spec_models["target"], [prompt], sp, num_scheduler_steps=4)
        got, st, steps, _ = _run(spec_models["target"], [prompt], sp, monkeypatch, num_scheduler_steps=4, **NGRAM)
        assert got == ref
        in_block = False
        for e in steps:
            if e.num_decode_steps > 1:
                in_block = True
            elif e.spec and e.spec["num_draft_tokens"] and in_block:
                back_on += 1
                assert st["spec_shadow_accepted_tokens"] > 0
    assert back_on > 0


def test_shadow_every_block_replays_without_gap_and_stays_lossless(spec_models, monkeypatch):
    """spec_shadow_every_block: a request in the shadow is replayed after every block (no 16-token gap, no
    doubling), so over the same greedy runs it gets more shadow probes than with the gap, its probe position never
    falls more than a block (+ the replay window) behind its output, and the output still equals plain decoding's."""
    rng = random.Random(9)
    sp = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    probes = {False: 0, True: 0}
    for _ in range(3):
        prompt = [rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(6, 16))]
        ref, _, _, _ = _run(spec_models["target"], [prompt], sp, num_scheduler_steps=4)
        for every in (False, True):
            lag = []
            shadow = Drafter.shadow_probe

            def watched(self, seqs, shadow=shadow, lag=lag):
                shadow(self, seqs)
                for s in seqs:
                    st = self._accept.get(s.request_id)
                    if st is not None and st.off and not st.first and not s.is_finished:
                        lag.append(s.num_output_tokens - st.next_probe)
            monkeypatch.setattr(Drafter, "shadow_probe", watched)
            got, st, _, _ = _run(spec_models["target"], [prompt], sp, monkeypatch, num_scheduler_steps=4,
                                 spec_shadow_every_block=every, **NGRAM)
            monkeypatch.setattr(Drafter, "shadow_probe", shadow)
            assert got == ref
            probes[every] += st["spec_shadow_probes"]
            if every:
                assert all(x <= 4 + 3 for x in lag)          # one block (4) + the replay window (min(k, 4) - 1)
    assert probes[True] > probes[False]


@pytest.mark.parametrize("every", [False, True])
def test_shadow_confirm_turns_drafting_on_only_after_two_replays_agree(spec_models, monkeypatch, every):
    """spec_shadow_confirm: a replay that would turn drafting back on only marks the request pending, which holds
    the pipeline after the block in flight; drafting comes back on only from the next replay, and only if that
    replay's own drafts would pay. Over greedy runs that do come back on, every switch back on was pending before,
    not every pending request comes back on, pending ones never draft, and the output equals plain decoding's."""
    rng = random.Random(9)
    sp = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    seen = dict(pending=0, on=0, on_unpending=0)
    shadow, slots = Drafter.shadow_probe, Drafter.num_draft_slots

    def watched(self, seqs):
        before = {s.request_id: (st.off, st.pending) for s in seqs if (st := self._accept.get(s.request_id))}
        shadow(self, seqs)
        for rid, (off, pending) in before.items():
            st = self._accept[rid]
            seen["pending"] += st.pending and not pending
            if off and not st.off:
                seen["on"] += 1
                seen["on_unpending"] += not pending

    def drafts(self, seq):
        st = self._accept.get(seq.request_id)
        k = slots(self, seq)
        assert not (st is not None and st.pending and k)
        return k
    monkeypatch.setattr(Drafter, "shadow_probe", watched)
    monkeypatch.setattr(Drafter, "num_draft_slots", drafts)
    for _ in range(3):
        prompt = [rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(6, 16))]
        ref, _, _, _ = _run(spec_models["target"], [prompt], sp, num_scheduler_steps=4)
        got, _, _, _ = _run(spec_models["target"], [prompt], sp, monkeypatch, num_scheduler_steps=4,
                            spec_shadow_every_block=every, spec_shadow_confirm=True, **NGRAM)
        assert got == ref
    assert seen["on"] > 0 and seen["on_unpending"] == 0
    assert seen["pending"] > seen["on"]                  # (not every pending request was confirmed)


def _run_graphs(prompts, sp, **cfg):
    eng = LLMEngine(model=None, device="cpu", dtype="float32", max_model_len=512, cpu_kv_cache_gib=0.05,
                    max_num_seqs=4, spec_cuda_graph_max_batch=2, **cfg)
    keys = []
    if eng.drafter is not None:
        g = CudaGraphRunner(eng.runner, eng.config, capture=False)   # the padded layout, run eagerly
        replay = g._replay
        g._replay = lambda key, md: (keys.append(key), replay(key, md))[1]
        eng.runner.graphs = g
    ks = []
    eng.events.subscribe(lambda e: ks.extend(r.num_spec_tokens for r in e.scheduled)
                         if isinstance(e, StepEvent) else None)
    for p in prompts:
        eng.add_request(eng.apply_chat_template([{"role": "user", "content": p}]), sp)
    outs = drain(eng)
    check_no_leak(eng)
    return [outs[k].token_ids for k in sorted(outs)], eng.stats(), keys, ks


TEXT = ("The city library opened in 1952 and quickly became the heart of the neighbourhood. Every Saturday "
        "morning, children gathered in the reading room to listen to stories, while their parents browsed the "
        "new arrivals.")


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False], ids=["fast-verify", "general-verify"])
def test_long_drafts_after_whole_acceptance(fast):
    """The bundled SmolLM2 copying a paragraph, num_speculative_tokens=2, num_speculative_tokens_max=8: a request
    whose drafts are accepted whole drafts 4, then 8 tokens, verified through the captured Q=9 layout (steps
    of 4..7 drafts pad up to it); greedy output equals plain decoding's, with fewer verify steps than with
    2 drafts, and without the switch no draft is longer than 2."""
    prompts = [f"Repeat the following text exactly, word for word:\n\n{TEXT}"]
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    spec = dict(speculative_method="ngram", num_speculative_tokens=2, ngram_min=1, ngram_max=4,
                speculative_auto_off=False, spec_fast_verify=fast)
    ref, _, _, _ = _run_graphs(prompts, sp)
    got, st, keys, ks = _run_graphs(prompts, sp, num_speculative_tokens_max=8, **spec)
    assert got == ref
    assert max(ks) == 8 and 4 in ks
    assert {q for _, q, _ in keys if q > 1} <= {2, 3, 9} and any(q == 9 for _, q, _ in keys)
    assert st["max_speculative_tokens"] == 8 and len(st["spec_decode_num_accepted_tokens_per_pos"]) == 8
    assert st["spec_decode_num_accepted_tokens_per_pos"][7] > 0
    short, st2, _, ks2 = _run_graphs(prompts, sp, **spec)
    assert short == ref and max(ks2) == 2
    assert st["spec_decode_num_drafts"] < st2["spec_decode_num_drafts"]      # fewer verify steps
