"""The speculative step's host-side fast paths: the per-request n-gram index proposes exactly what the history
scan (ngram_propose) proposes, and the fast verify path (padded graph layout packed directly, greedy
verification from the device argmax) gives the general path's tokens and counters, alone, batched, with
requests that draft nothing and under preemption, and stands aside for requests it does not cover. The graph
runner's static-buffer forward runs eagerly here (capture=False), as in test_spec_graphs.py."""
import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.worker.cuda_graphs import CudaGraphRunner
from engine.spec import ngram
from engine.spec.ngram import NgramIndex, ngram_propose
from helpers import SPEC_VOCAB, check_no_leak, drain

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ngram_index_proposes_what_the_scan_proposes():
    rng = random.Random(0)
    checked = found = 0
    for _ in range(400):
        vocab = rng.choice([2, 3, 6, 40])
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        index = NgramIndex(n_min, n_max)
        toks = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 3, 50, 200]))]   # 50, 200: prompt-sized
        for _ in range(rng.randint(1, 25)):
            k = rng.randint(0, 5)
            got = index.propose(toks, k)
            assert got == ngram_propose(toks, n_min, n_max, k), (toks, n_min, n_max, k)
            checked += 1
            found += bool(got)
            toks += [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 2, 5, 40]))]   # a step's tokens
    assert found > checked // 3 and found < checked                 # both outcomes exercised


def _engine(target, graphs=True, **cfg):
    eng = LLMEngine(model=target, device="cpu", dtype="float32", block_size=4, max_model_len=64,
                    num_kv_blocks=cfg.pop("num_kv_blocks", 300), max_num_batched_tokens=64, max_num_seqs=8,
                    spec_cuda_graph_max_batch=8, speculative_auto_off=False, **cfg)
    calls = []
    if graphs:
        g = CudaGraphRunner(eng.runner, eng.config, capture=False)
        run_padded = g.run_padded
        g.run_padded = lambda key, *a: (calls.append(key), run_padded(key, *a))[1]
        eng.runner.graphs = g
    if eng.fast_verify is not None:             # which steps took the fast path, with their draft lengths
        launch = eng.fast_verify.launch
        eng.fast_verify.launch = lambda sched, key: (calls.append(list(sched.num_spec_tokens)),
                                                     launch(sched, key))[1]
    return eng, calls


def _requests(eng, n, params=None, seed=7):
    rng = random.Random(seed)
    for i in range(n):
        body = [rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(3, 12))]
        prompt = body * 2 if i % 3 else body + [rng.randrange(2, SPEC_VOCAB) for _ in range(6)]
        sp = params[i] if params else SamplingParams(temperature=0.0, max_tokens=rng.randrange(12, 30),
                                                     ignore_eos=True)
        eng.add_request(prompt, sp)
    outs = drain(eng)
    check_no_leak(eng)
    return [outs[k] for k in sorted(outs)]


SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos")


@pytest.mark.parametrize("n, blocks", [(1, 300), (7, 300), (7, 18)], ids=["alone", "batched", "preemption"])
def test_fast_verify_matches_the_general_path(spec_models, n, blocks):
    target = spec_models["target"]
    ref = [o.token_ids for o in _requests(_engine(target, graphs=False, num_kv_blocks=blocks)[0], n)]
    general, gcalls = _engine(target, num_kv_blocks=blocks, spec_fast_verify=False, **SPEC)
    slow = [o.token_ids for o in _requests(general, n)]
    fast, calls = _engine(target, num_kv_blocks=blocks, **SPEC)
    got = [o.token_ids for o in _requests(fast, n)]
    assert got == slow == ref
    st, st_general = fast.stats(), general.stats()
    assert [st[c] for c in COUNTERS] == [st_general[c] for c in COUNTERS] and st["spec_decode_num_drafts"] > 0
    assert not gcalls                                               # the switch turns the fast path off
    fast_steps = [c for c in calls if isinstance(c, list)]
    assert len(fast_steps) == sum(1 for c in calls if isinstance(c, tuple)) > 0   # each replayed a verify graph
    if n > 1:
        assert any(0 in ks and max(ks) > 0 for ks in fast_steps)   # requests without drafts ride along (Q rows)
        assert any(len(set(ks)) > 1 for ks in fast_steps)
    if blocks < 50:
        assert st["num_preemptions_total"] > 0


def test_fast_verify_stands_aside_for_requests_it_does_not_cover(spec_models):
    """Logprobs, penalties and sampled requests need the logits: steps that hold one take the general path,
    and the greedy requests around them keep their tokens."""
    target = spec_models["target"]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1), greedy,
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2)]
    ref = _requests(_engine(target, graphs=False)[0], 4, params)
    eng, calls = _engine(target, **SPEC)
    got = _requests(eng, 4, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [e[0].logprob for o in got if o.logprobs for e in o.logprobs] == \
        pytest.approx([e[0].logprob for o in ref if o.logprobs for e in o.logprobs], abs=1e-4)
    assert not calls                   # the two special requests run to the end with the others: never fast
    eng, calls = _engine(target, **SPEC)
    sampled = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=i) for i in range(3)]
    _requests(eng, 3, sampled)
    assert not calls and eng.stats()["spec_decode_num_drafts"] > 0


def test_long_histories_are_scanned_with_the_same_drafts(spec_models, monkeypatch):
    """Past INDEX_MAX_TOKENS a request's history is scanned instead of indexed: the same drafts, so the same
    counters and tokens."""
    target = spec_models["target"]
    scans = []
    scan = ngram.ngram_propose
    monkeypatch.setattr(ngram, "ngram_propose", lambda *a: (scans.append(1), scan(*a))[1])
    eng, _ = _engine(target, **SPEC)
    indexed = [o.token_ids for o in _requests(eng, 5)]
    counters = [eng.stats()[c] for c in COUNTERS]
    assert not scans
    monkeypatch.setattr(ngram, "INDEX_MAX_TOKENS", 24)             # some prompts start below it and cross it
    eng, _ = _engine(target, **SPEC)
    assert [o.token_ids for o in _requests(eng, 5)] == indexed
    assert [eng.stats()[c] for c in COUNTERS] == counters
    assert scans


def test_prompts_are_indexed_during_their_prefill_with_the_same_drafts(spec_models):
    """NgramDrafter.prefetch (EngineConfig.spec_prefetch): a step that computes a prompt's last chunk indexes the prompt while the forward
    runs (a chunked prompt: at its last chunk), so the first proposal only extends the index by the sampled token;
    every draft still equals the scan's, and the tokens and counters equal those without prefetching."""
    target = spec_models["target"]
    eng, _ = _engine(target, **SPEC)
    seen, drafts = [], []
    prefetch, draft = eng.drafter.prefetch, eng.drafter.draft

    def watched(sched):
        prefetch(sched)
        for seq, n, start in zip(sched.seqs, sched.num_new_tokens, sched.computed_before):
            ix = eng.drafter._index.get(seq.request_id)
            last = start < seq.num_prompt_tokens <= start + n
            if last:
                assert ix is not None and ix.ends == seq.num_prompt_tokens
            seen.append(last)

    def checked(cands):
        draft(cands)
        for seq, k in cands:
            drafts.append(seq.spec_token_ids == ngram_propose(seq.token_ids, 1, 3, k))
    eng.drafter.prefetch, eng.drafter.draft = watched, checked
    outs = [o.token_ids for o in _requests(eng, 6)]
    counters = [eng.stats()[c] for c in COUNTERS]
    assert sum(seen) == 6 and drafts and all(drafts)
    eng, _ = _engine(target, spec_prefetch=False, **SPEC)
    assert [o.token_ids for o in _requests(eng, 6)] == outs
    assert [eng.stats()[c] for c in COUNTERS] == counters
