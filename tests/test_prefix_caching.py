"""Prefix caching: identical greedy outputs with and without it on prompts sharing long prefixes
(alone, batched, chunked prefill, forced preemption); exact counters in outputs, metrics, step events and
stats; a preempted request finds its own blocks again; evictions are reported; a seeded workload with
shared prefixes, aborts and preemptions returns every block."""
import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.core.kv_cache_manager import BlockManager
from engine.events import RequestEvent, StepEvent
from engine.core.sequence import Sequence
from helpers import check_block_invariants, drain, run_requests

SYSTEM = ("You are Atlas, a meticulous assistant for a small public library. You answer questions about opening "
          "hours, borrowing rules, late fees, the children's reading programme, interlibrary loans and the "
          "community events calendar. Keep answers short, friendly and factual; if you do not know something, "
          "say so and suggest asking the front desk. Never invent book titles, prices or dates.")
QUESTIONS = ["When does the library open on Saturdays?", "How much is the late fee for a DVD?",
             "Can I borrow an e-book from another library?"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def run(eng, prompts, params=GREEDY):
    return run_requests(eng, prompts, [params] * len(prompts))


@pytest.fixture(scope="module")
def prompts(smollm2_engine_factory):
    eng = smollm2_engine_factory(enable_prefix_caching=False)
    ps = [eng.tokenizer(eng.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": q}]), add_special_tokens=False).input_ids
          for q in QUESTIONS]
    return ps


@pytest.fixture(scope="module")
def shared_blocks(prompts):
    n = 0
    while all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    assert n >= 5 * 16, n                     # a long shared prefix: >= 5 full blocks
    return n // 16


@pytest.fixture(scope="module")
def reference(smollm2_engine_factory, prompts):
    eng = smollm2_engine_factory(enable_prefix_caching=False)
    outs = [run(eng, [p])[0] for p in prompts]
    assert all(o.num_cached_tokens == 0 for o in outs) and eng.stats()["prefix_cache_hits"] == 0
    return [o.token_ids for o in outs]


@pytest.mark.slow
def test_alone(smollm2_engine_factory, prompts, reference, shared_blocks):
    eng = smollm2_engine_factory()
    outs = [run(eng, [p])[0] for p in prompts]
    assert [o.token_ids for o in outs] == reference
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == shared_blocks * 16 for o in outs[1:])
    assert all(o.metrics.num_cached_tokens == o.num_cached_tokens for o in outs)


@pytest.mark.slow
def test_batched_after_warmup(smollm2_engine_factory, prompts, reference, shared_blocks):
    eng = smollm2_engine_factory()
    run(eng, [prompts[0][:shared_blocks * 16 + 1]])            # warm the cache with the shared prefix only
    outs = run(eng, prompts)
    assert [o.token_ids for o in outs] == reference
    assert all(o.num_cached_tokens == shared_blocks * 16 for o in outs)


@pytest.mark.slow
def test_chunked_prefill(smollm2_engine_factory, prompts, reference, shared_blocks):
    eng = smollm2_engine_factory(max_num_batched_tokens=16)   # every prompt split into 16-token chunks
    outs = run(eng, prompts)
    assert [o.token_ids for o in outs] == reference
    # the first computes the prefix chunk by chunk; the others are admitted later and find it committed
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == shared_blocks * 16 for o in outs[1:])


@pytest.mark.slow
def test_forced_preemption(smollm2_engine_factory, prompts, shared_blocks):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)    # decodes cross a block boundary
    ref_eng = smollm2_engine_factory(enable_prefix_caching=False)
    ref = [o.token_ids for o in run(ref_eng, prompts[:2], sp)]
    eng = smollm2_engine_factory(num_kv_blocks=10)             # 9 usable: two ~8-block requests sharing 5
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(e))
    outs = run(eng, prompts[:2], sp)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref
    assert outs[1].num_cached_tokens == shared_blocks * 16
    # the preempted request is re-admitted onto cached blocks (the shared prefix and its own)
    pre = {r for e in steps for r in e.preempted}
    readmit = [e for e in steps if e.blocks_shared and any(s.request_id in pre for s in e.scheduled)]
    assert readmit and readmit[-1].blocks_shared >= shared_blocks
    pool = eng.block_manager.pool
    assert all(r == 0 for r in pool.ref_counts) and pool.num_free == eng.num_blocks - 1


# ---------------------------------------------------------------- counters, exact
def test_counters_in_outputs_metrics_events_and_stats():
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, block_size=16)
    events = []
    eng.events.subscribe(events.append)
    shared = list(range(100, 148))                              # 3 full blocks
    a = eng.add_request(shared + [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    n_a = len(events)
    b = eng.add_request(shared + [7, 8, 9, 10, 11], SamplingParams(max_tokens=2, ignore_eos=True))
    outs = drain(eng)
    steps_a = [e for e in events[:n_a] if isinstance(e, StepEvent)]
    steps_b = [e for e in events[n_a:] if isinstance(e, StepEvent)]
    assert sum(e.prefix_cache_queries for e in steps_a) == 51 and sum(e.prefix_cache_hits for e in steps_a) == 0
    assert steps_b[0].prefix_cache_queries == 53 and steps_b[0].prefix_cache_hits == 48
    assert steps_b[0].blocks_shared == 3 and len(steps_b[0].blocks_allocated) == 1   # only the private tail
    assert steps_b[0].scheduled[0].num_tokens == 5 and steps_b[0].scheduled[0].num_computed_before == 48
    assert outs[b].num_cached_tokens == outs[b].metrics.num_cached_tokens == 48
    sched = next(e for e in events[n_a:] if isinstance(e, RequestEvent) and e.kind == "scheduled")
    assert sched.request_id == b and sched.num_cached_tokens == 48 and len(sched.block_table) == 4
    st = eng.stats()
    assert st["prefix_cache_queries"] == 51 + 53 and st["prefix_cache_hits"] == 48
    assert a != b


def test_evictions_are_reported_lru_first():
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=9, block_size=4, max_model_len=32)  # 8 usable
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(e))
    for base in (100, 200):                                     # 2 x 16 prompt tokens -> 4 full blocks each
        eng.add_request(list(range(base, base + 16)), SamplingParams(max_tokens=1, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    pool = eng.block_manager.pool
    cached = [b for b in range(1, 9) if pool.block_hash[b] is not None]
    assert len(cached) == 8 and pool.num_free == 8 and not any(e.blocks_evicted for e in steps)
    first_req = steps[0].blocks_allocated
    steps.clear()
    eng.add_request(list(range(300, 310)), SamplingParams(max_tokens=1, ignore_eos=True))   # 3 fresh blocks
    while eng.has_unfinished_requests():
        eng.step()
    evicted = [b for e in steps for b in e.blocks_evicted]
    assert len(evicted) == 3 and set(evicted) <= set(first_req)   # the least recently used request's blocks go first
    assert len({*pool.hash_to_block.values()}) == len(pool.hash_to_block)


def test_preempted_request_finds_its_own_blocks_again():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    s = Sequence("s", None, list(range(10, 21)), SamplingParams(), 0.0)      # 11 tokens: 2 full blocks + tail
    bm.match_prefix(s)
    bm.record_admission(s)
    bm.allocate(s, 11)
    s.num_computed_tokens = 11
    bm.commit_computed(s)
    s.admitted = True
    s.append_token(5)
    own = list(s.block_table[:2])
    bm.free(s)                                                  # what preemption does
    s.num_computed_tokens = 0
    bm.match_prefix(s)
    assert s.block_table == own and s.num_computed_tokens == 8
    assert [bm.pool.ref_counts[b] for b in own] == [1, 1]
    bm.record_admission(s)
    assert bm.total_queries == 11 and bm.total_hits == 0        # re-admission is not a new cache query


# ---------------------------------------------------------------- a seeded workload that surely preempts
@pytest.mark.slow
def test_seeded_workload_with_shared_prefixes_aborts_and_preemptions():
    rng = random.Random(5)
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=24, block_size=4, max_num_seqs=6,
                    max_num_batched_tokens=32, max_model_len=80)
    system = [rng.randrange(49152) for _ in range(18)]
    live, aborted = [], 0
    for step in range(150):
        if step < 100 and rng.random() < 0.5:
            prompt = system + [rng.randrange(49152) for _ in range(rng.randint(1, 12))]
            live.append(eng.add_request(prompt, SamplingParams(max_tokens=rng.randint(4, 30), ignore_eos=True)))
        if live and rng.random() < 0.08:
            eng.abort_request(live.pop(rng.randrange(len(live))))
            aborted += 1
        eng.step()
        check_block_invariants(eng)
    while eng.has_unfinished_requests():
        eng.step()
        check_block_invariants(eng)
    st = eng.stats()
    assert eng.scheduler.num_preemptions > 0 and aborted > 0 and st["prefix_cache_hits"] > 0
    pool = eng.block_manager.pool
    assert all(r == 0 for r in pool.ref_counts)
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.seqs
    assert pool.num_free == pool.num_usable                     # free + cached-free = the whole pool
    assert 0 < sum(h is not None for h in pool.block_hash) <= pool.num_usable


# ---------------------------------------------------------------- inspector: block map, block table, hit rate
def test_inspector_shows_cache_states_hits_and_hit_rate():
    import numpy as np

    from inspector import figures as F
    from inspector.recorder import Recorder
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=32, block_size=4)
    rec = Recorder().attach(eng.events)
    system = list(range(1000, 1012))                            # 3 full blocks
    eng.add_request(system + [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))   # 4 full blocks
    while eng.has_unfinished_requests():
        eng.step()
    a = eng.add_request(system + [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    b = eng.add_request(system + [8, 9], SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.step()
    snap = rec.snapshot(kv=eng.kv_snapshot())
    kv = snap.kv
    assert kv["num_cached_tokens"] == {a: 12, b: 12}
    st = F.block_states(kv)
    shared = kv["block_tables"][a][:3]
    assert kv["block_tables"][b][:3] == shared and all(st["ref"][x] == 2 and st["cat"][x] == 2 for x in shared)
    assert st["num_cached_free"] >= 1 and st["num_free"] > 0     # the first request's private tail stayed cached
    spec = F.block_map_spec(kv)
    text = sum(next(d for d in spec["data"] if d["type"] == "heatmap")["text"], [])
    assert a in text[shared[0]] and b in text[shared[0]] and "ref 2" in text[shared[0]]
    cf = int(np.nonzero((st["ref"] == 0) & st["cached"])[0][0])
    assert "cached-free" in text[cf]
    bt = F.block_table_spec(kv, a)
    cells = [c for row in bt["data"][0]["text"] for c in row if c]
    assert cells[:3] == [f"{x}*" for x in shared] and not cells[3].endswith("*")
    assert "3 from the prefix cache" in json_text(bt)
    hit = next(d for d in F.throughput_spec(snap)["data"] if d["name"] == "prefix-cache hit %")
    ys = [y for y in hit["y"] if y is not None]
    assert ys and max(ys) > 0 and all(0 <= y <= 100 for y in ys)
    q, h = snap.totals["prefix_cache_queries"], snap.totals["prefix_cache_hits"]
    assert (q, h) == (16 + 15 + 14, 24)


def json_text(spec):
    import json
    return json.dumps(spec)
