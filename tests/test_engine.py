"""Engine behaviour on the bundled SmolLM2: identical greedy (and seeded) outputs under every scheduling switch."""
import dataclasses
from collections import Counter

import pytest

from engine import SamplingParams
from helpers import drain, run_requests

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France?", "Name three colours of the rainbow.",
         "Write one sentence about cats.", "Count from one to ten in words, separated by commas, please."]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_engine_factory):
    eng = smollm2_engine_factory()
    return [eng.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def params():
    return [GREEDY, SEEDED, GREEDY, GREEDY]


@pytest.fixture(scope="module")
def reference(smollm2_engine_factory, prompts, params):
    """Each request alone, on a default engine."""
    eng = smollm2_engine_factory()
    return [run_requests(eng, [p], [sp])[0].token_ids for p, sp in zip(prompts, params)]


def test_reference_is_meaningful(reference):
    assert all(len(r) == 16 for r in reference)
    assert len({tuple(r) for r in reference}) == 4


@pytest.mark.parametrize("cfg", [
    dict(),                                                        # batched, continuous
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16),  # prompts split into chunks, mixed steps
    dict(enable_chunked_prefill=False, max_num_batched_tokens=2048),
    dict(scheduling="static", max_num_seqs=3),                     # batch runs until all finish
    dict(enable_prefix_caching=False),
    dict(enable_kv_cache=False),                                   # recompute the whole prefix every step
    dict(block_size=8, max_num_seqs=2),
    dict(num_scheduler_steps=4),                                   # multi-step decode once all are greedy
    dict(gemv_max_tokens=8),                                       # decode steps through the fused linears
], ids=["batched", "chunked16", "nochunk", "static", "noprefix", "nocache", "bs8-seqs2", "multistep4", "gemv8"])
def test_same_outputs_under_switches(smollm2_engine_factory, prompts, params, reference, cfg):
    eng = smollm2_engine_factory(**cfg)
    n = 8                       # the reference's first 8 tokens: each switch changes how prompts and steps are batched
    outs = run_requests(eng, prompts, [dataclasses.replace(p, max_tokens=n) for p in params])
    assert [o.token_ids for o in outs] == [r[:n] for r in reference]
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_forced_preemption_same_outputs(smollm2_engine_factory, prompts, params, reference):
    # 4 requests of ~40-50 tokens each need ~16 blocks of 16; give the pool 10
    eng = smollm2_engine_factory(num_kv_blocks=10, enable_prefix_caching=False)
    outs = run_requests(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == eng.scheduler.num_preemptions
    assert [o.token_ids for o in outs] == reference
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_prefix_cache_hits_on_shared_prompt(smollm2_engine_factory, prompts):
    eng = smollm2_engine_factory()
    first = run_requests(eng, [prompts[3]], [GREEDY])[0]
    again = run_requests(eng, [prompts[3]], [GREEDY])[0]
    assert first.num_cached_tokens == 0
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.token_ids == first.token_ids


def test_stop_strings_and_streaming_text(smollm2_engine_factory, prompts):
    eng = smollm2_engine_factory()
    full = run_requests(eng, [prompts[3]], [SamplingParams(temperature=0, max_tokens=40)])[0]
    stop = full.text[9:12]
    assert len(full.text) > 14 and len(stop) == 3
    sp = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    rid = eng.add_request(prompts[3], sp)
    streamed, final = "", None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid:
                streamed += o.delta_text
                final = o
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[:full.text.index(stop)]
    assert streamed == final.text           # the held-back partial stop string never leaked


def test_logprobs(smollm2_engine_factory, prompts):
    eng = smollm2_engine_factory()
    out = run_requests(eng, [prompts[0]], [SamplingParams(temperature=0, max_tokens=4, logprobs=3)])[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        chosen, top = entry[0], entry[1:]
        assert chosen.token_id == tok and len(top) == 3
        assert top[0].token_id == tok              # greedy picks the most likely token
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
        assert chosen.logprob <= 0


def test_request_metrics(smollm2_engine_factory, prompts):
    eng = smollm2_engine_factory()
    outs = run_requests(eng, prompts[:2], [GREEDY, GREEDY])
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == 16 and m.token_times == sorted(m.token_times)
        assert o.ttft > 0 and o.tpot > 0
        assert abs(o.tpot - (m.last_token_time - m.first_token_time) / 15) < 1e-9


def test_multi_step_decode_matches_single_step(smollm2_engine_factory, prompts):
    """K decode iterations per host round trip: same tokens, stops mid-run honoured, every block back."""
    lens = [5, 16, 9, 13]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    ref_eng = smollm2_engine_factory()
    ref = run_requests(ref_eng, prompts, params)
    stop = ref[3].text[6:9]
    params[3] = SamplingParams(temperature=0, max_tokens=13, stop=[stop])
    ref[3] = run_requests(ref_eng, [prompts[3]], [params[3]])[0]
    for cfg in (dict(num_scheduler_steps=4), dict(num_scheduler_steps=3, num_kv_blocks=10,
                                                    enable_prefix_caching=False)):
        eng = smollm2_engine_factory(**cfg)
        steps = []
        eng.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
        outs = run_requests(eng, prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert [o.text for o in outs] == [r.text for r in ref] and outs[3].finish_reason == "stop"
        multi = [e for e in steps if e.num_decode_steps > 1]
        assert multi and all(e.num_decode_tokens == e.num_decode_steps * len(e.scheduled) for e in multi)
        assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
        assert all(rc == 0 for rc in eng.block_manager.pool.ref_counts[1:])


def test_multi_step_trim_skips_discarded_iterations(smollm2_engine_factory, prompts):
    """EngineConfig.multi_step_trim: a block behind the one in flight leaves out the requests that reach max_tokens
    in that block, and no block runs past its longest request's max_tokens: the same tokens with fewer decode
    rows computed, every block back."""
    lens = [3, 11, 6, 20]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    rows, outs = {}, {}
    for trim in (False, True):
        eng = smollm2_engine_factory(num_scheduler_steps=4, multi_step_trim=trim)
        steps = []
        eng.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
        outs[trim] = [o.token_ids for o in run_requests(eng, prompts, params)]
        rows[trim] = sum(e.num_decode_tokens for e in steps if e.num_decode_steps > 1)
        assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
    assert outs[True] == outs[False] and [len(t) for t in outs[True]] == lens
    assert 0 < rows[True] < rows[False]


def _staggered(eng, prompts, params, arrive_at: dict[int, int]):
    """Requests i not in `arrive_at` first; request i is added before engine step arrive_at[i]."""
    ids = {i: eng.add_request(p, sp) for i, (p, sp) in enumerate(zip(prompts, params)) if i not in arrive_at}
    outs, step = {}, 0
    while eng.has_unfinished_requests() or len(ids) < len(prompts):
        for i, at in arrive_at.items():
            if at == step:
                ids[i] = eng.add_request(prompts[i], params[i])
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
    return [outs[ids[i]].token_ids for i in range(len(prompts))]


def _allowed_tokens(logits, p, slack: float = 1e-4) -> set:
    """The tokens SamplingParams `p` may draw from a row of logits, computed here from the definitions (float64):
    temperature, then the top_k highest, then the smallest prefix of those whose mass reaches top_p, then those
    with probability >= min_p x the largest. `slack` widens the cuts a hair (float32 rounding in the engine)."""
    lg = logits.double() / p.temperature
    keep = lg.topk(p.top_k).indices if p.top_k > 0 else lg.argsort(descending=True)
    probs = lg[keep].softmax(0)
    before = probs.cumsum(0) - probs                       # mass strictly before each token
    keep = keep[before < p.top_p + slack]
    probs = lg[keep].softmax(0)
    keep = keep[probs >= p.min_p * probs.max() * (1 - slack)]
    assert len(keep) >= 1
    return set(keep.tolist())


def test_multi_step_with_filtered_sampling(smollm2_engine_factory, prompts, monkeypatch):
    """Unseeded top-k / top-p / min-p sampling stays on the device, so it runs multi-step too; every token it
    draws lies in the top-k / top-p / min-p set of the logits it was drawn from."""
    import engine.sample.sampler as sampler_mod
    import engine.worker.multi_step as multi_step_mod
    draws = []                         # (logits row, params, token) of every non-greedy row sampled
    real = sampler_mod.sample_unseeded

    def spy(logits, rows, greedy, generator, fused=False):
        toks = real(logits, rows, greedy, generator, fused)
        for i, (r, g) in enumerate(zip(rows, greedy)):
            if not g:
                draws.append((logits[i].detach().clone(), r.params, int(toks[i])))
        return toks
    monkeypatch.setattr(sampler_mod, "sample_unseeded", spy)
    monkeypatch.setattr(multi_step_mod, "sample_unseeded", spy)

    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, max_tokens=n, ignore_eos=True)
              for n in (7, 12, 9, 16)]
    eng = smollm2_engine_factory(num_scheduler_steps=4)
    steps = []
    eng.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
    outs = run_requests(eng, prompts, params)
    assert [len(o.token_ids) for o in outs] == [7, 12, 9, 16]
    assert any(e.num_decode_steps > 1 for e in steps)
    # every output token was one of the spied draws (a multi-step block may draw past max_tokens and discard)
    drawn = Counter(t for _, _, t in draws)
    assert not Counter(t for o in outs for t in o.token_ids) - drawn
    allowed = [_allowed_tokens(lg, p) for lg, p, _ in draws]
    bad = [(t, len(a)) for (_, _, t), a in zip(draws, allowed) if t not in a]
    assert not bad, bad
    # the filters did cut: most draws came from a set well below top_k
    assert sum(len(a) < 40 for a in allowed) > len(allowed) // 2
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_multi_step_time_cap(smollm2_engine_factory, prompts):
    """multi_step_max_ms bounds a block by the measured time per iteration: a cap below one iteration
    leaves pipelined blocks of one iteration each, a generous one allows the full K; tokens are the same."""
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4
    results = {}
    for cap in (1e-6, 1e6):
        eng = smollm2_engine_factory(num_scheduler_steps=4, multi_step_max_ms=cap)
        steps, blocks = [], []
        eng.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
        run_block = eng.multi_step.run
        eng.multi_step.run = lambda K, pending, mixed=None: blocks.append(K) or run_block(K, pending, mixed)
        results[cap] = [o.token_ids for o in run_requests(eng, prompts, params)]
        assert eng.multi_step.decode_iter_s is not None and eng.multi_step.decode_iter_s > 0
        k = max(e.num_decode_steps for e in steps)
        assert k == (1 if cap < 1 else 4), (cap, k)
        plans = [e for e in steps if e.block_plan]              # each block says why it runs that many iterations
        assert plans and all(e.block_plan["host_round_ms"] is None for e in plans)   # (on a CPU: synchronous)
        assert all(e.num_decode_steps == min(4, e.block_plan["budget_iterations"]) for e in plans)
        assert len(blocks) >= (8 if cap < 1 else 2), blocks      # decode went through blocks, not plain steps
    assert results[1e-6] == results[1e6]


def test_multi_step_time_cap_hides_the_host_round_trip(smollm2_engine_factory):
    """A block runs as many iterations as multi_step_max_ms allows at the measured time per iteration, but, unless
    newcomers wait, never fewer than hide the host's measured round trip between blocks (capped by
    num_scheduler_steps)."""
    ms = smollm2_engine_factory(num_scheduler_steps=8, multi_step_max_ms=4.0).multi_step
    assert ms._time_cap() == 1                          # nothing measured yet: a first block of one iteration
    for iter_ms, host_ms, want in [(1.0, 0.5, 4),       # the budget's fit; the host hides behind one iteration
                                   (3.0, 0.5, 2),       # one iteration fits: two, or the GPU idles per round trip
                                   (5.0, 0.5, 1),       # longer than the budget, host hidden: one each
                                   (5.0, 12.0, 3),      # host-bound: enough iterations to cover 12 ms
                                   (5.0, 100.0, 8),     # ... up to num_scheduler_steps
                                   (1.0, 6.5, 7)]:      # the host's need beats the budget's fit
        ms.decode_iter_s, ms.host_round_s = iter_ms / 1e3, host_ms / 1e3
        assert ms._time_cap() == want, (iter_ms, host_ms)
        assert ms._time_cap(host=False) == min(want, 4 if iter_ms < 2 else 2 if iter_ms < 4 else 1)
    ms.host_round_s = None                              # (on a CPU blocks run synchronously: never measured)
    ms.decode_iter_s = 5e-3
    assert ms._time_cap() == 1


def test_a_block_covers_the_host_round_trip_unless_newcomers_wait(smollm2_engine_factory, prompts):
    """Behind a decode block in flight, the next block's length covers the host's round trip; once a newcomer
    waits (the batch full, so no step admits it), the budget alone decides, as it does behind a mixed step."""
    eng = smollm2_engine_factory(num_scheduler_steps=8, multi_step_max_ms=4.0, max_num_seqs=2)
    ms = eng.multi_step
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for p in prompts[:2]:
        eng.add_request(p, params)
    while ms.inflight is None or ms.inflight.advance is not None:
        eng.step()
    ahead = ms.inflight
    ms.decode_iter_s, ms.host_round_s = 5e-3, 20e-3        # iterations longer than the budget, a slow host
    assert ms.plan(False, ahead=ahead) == 4
    assert ms.plan(True, ahead=ahead) == 1                  # a request is on its way in
    eng.add_request(prompts[2], params)
    assert ms.plan(False, ahead=ahead) == 1
    drain(eng)
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_multi_step_admits_newcomers_in_groups(smollm2_engine_factory, prompts):
    """With the batch full, newcomers wait (decoding continues multi-step) until multi_step_admit_min slots
    are free or all of them fit; tokens are unchanged."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 12, 20, 20)]
    extra = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)] * 2
    ref = run_requests(smollm2_engine_factory(), prompts + prompts[:2], params + extra)
    for admit_min in (1, 2):
        eng = smollm2_engine_factory(num_scheduler_steps=4, max_num_seqs=4, multi_step_admit_min=admit_min)
        events = []
        eng.events.subscribe(events.append)
        outs = run_requests(eng, prompts + prompts[:2], params + extra)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        step_of = {(e.kind, e.request_id): e.step for e in events if hasattr(e, "request_id")}
        fin1 = step_of[("finished", outs[1].request_id)]        # the second slot frees here
        first_new = min(step_of[("scheduled", o.request_id)] for o in outs[4:])
        if admit_min == 1:
            assert first_new <= fin1, (first_new, fin1)      # admitted at the first free slot
        else:
            assert first_new > fin1, (first_new, fin1)       # waited until two slots were free


def test_a_synchronous_step_returns_with_the_first_decode_block_launched(smollm2_engine_factory, prompts):
    """After the prefill step, the decode block the next step would run is already launched when step()
    returns (the clients' outputs are sent while it runs); the tokens are single steps' tokens."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 4
    ref = run_requests(smollm2_engine_factory(), prompts, params)
    eng = smollm2_engine_factory(num_scheduler_steps=4)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    eng.step()                                  # the prompts' prefill: a synchronous step
    assert eng.multi_step.inflight is not None
    assert [s.request_id for s in eng.multi_step.inflight.sched.seqs] == ids
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[i].token_ids for i in ids] == [r.token_ids for r in ref]
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_a_burst_is_admitted_by_mixed_steps_launched_back_to_back(smollm2_engine_factory, prompts):
    """Prompts that wait together (a burst) are admitted by mixed steps each launched behind the one before it,
    without a host sync between them: whole prompts within the token budget, beside the decodes of those admitted
    before. A prompt longer than the budget takes a synchronous step for its first chunk; the mixed step after it
    computes the rest. Every request gets the tokens it gets alone and every block comes back."""
    tokenize = smollm2_engine_factory().tokenize
    prompts = [tokenize(p) for p in prompts]
    ref = [run_requests(smollm2_engine_factory(), [p], [GREEDY])[0].token_ids for p in prompts]
    long_prompt = prompts[3] + prompts[0]
    budget = len(prompts[0]) + len(prompts[1]) + 4
    assert len(long_prompt) > budget and len(long_prompt) - budget + 4 + len(prompts[1]) <= budget
    ref_long = run_requests(smollm2_engine_factory(), [long_prompt], [GREEDY])[0].token_ids
    eng = smollm2_engine_factory(num_scheduler_steps=4, max_num_batched_tokens=budget)
    mixed, steps = [], []
    launch = eng.multi_step.launch_mixed
    eng.multi_step.launch_mixed = lambda plan, prev=None: mixed.append((prev, launch(plan, prev))) or mixed[-1][1]
    eng.events.subscribe(lambda e: steps.append(e) if getattr(e, "kind", "") == "step" else None)
    ids = [eng.add_request(p, GREEDY) for p in [long_prompt] + prompts]
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert [outs[i].token_ids for i in ids] == [ref_long] + ref
    first, rest = mixed[0][1].sched, mixed[1:]
    assert mixed[0][0] is None and first.seqs[0].request_id == ids[0]      # after the first chunk's step
    assert first.num_new_tokens[0] == len(long_prompt) - budget           # the rest of the long prompt
    admitted = [s.request_id for _, m in mixed for s in m.sched.admitted]
    assert admitted == ids[1:]                                             # every other prompt by a mixed step
    assert all(prev is not None for prev, _ in rest)                       # each behind the one before it
    assert all(sum(m.sched.num_new_tokens) <= budget for _, m in mixed)
    assert sum(1 for e in steps if e.num_prefill_tokens and e.num_decode_steps == 1 and not e.cuda_graph) >= 1
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_newcomers_join_behind_the_block_in_flight(smollm2_engine_factory, prompts):
    """Requests that arrive while decode blocks run are prefilled in a mixed step launched behind the block in
    flight, beside the running requests' next tokens (no drain, no synchronous step), and every request gets
    the tokens it gets alone. The first prompts, with nothing in flight, are a mixed step too. A newcomer with
    prompt logprobs (not sampled on the device alone) is admitted by a synchronous step instead."""
    ref = [run_requests(smollm2_engine_factory(), [p], [GREEDY])[0].token_ids for p in prompts]
    lp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    eng = smollm2_engine_factory(num_scheduler_steps=4)
    mixed = []
    launch = eng.multi_step.launch_mixed
    eng.multi_step.launch_mixed = lambda plan, prev=None: mixed.append((prev, launch(plan, prev))) or mixed[-1][1]
    ids = [eng.add_request(p, GREEDY) for p in prompts[:2]]
    done = {}

    def step(n):
        for _ in range(n):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
    step(3)                                     # prefill, then decode blocks in flight
    assert len(mixed) == 1 and mixed[0][0] is None                    # the prompts: nothing was in flight
    assert [s.request_id for s in mixed[0][1].sched.admitted] == ids
    assert eng.multi_step.inflight is not None
    ids.append(eng.add_request(prompts[2], GREEDY))
    step(2)
    assert len(mixed) == 2 and mixed[1][0] is not None                # behind the block in flight
    assert [s.request_id for s in mixed[1][1].sched.admitted] == [ids[2]]
    assert mixed[1][1].sched.num_new_tokens[:2] == [1, 1]             # the running requests decode beside it
    ids.append(eng.add_request(prompts[3], lp))
    while eng.has_unfinished_requests():
        step(1)
    assert len(mixed) == 2                      # the prompt-logprobs request took a synchronous step
    assert [done[i].token_ids for i in ids] == ref
    assert done[ids[3]].prompt_logprobs is not None
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
