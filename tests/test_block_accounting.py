"""Block accounting: randomized workloads with aborts and preemptions leave no block held (and, greedy, give each
request its tokens alone); prefix-cache rules."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLMEngine, SamplingParams
from engine.core.kv_cache_manager import BlockManager
from engine.core.sequence import Sequence
from helpers import check_block_invariants, run_requests


@pytest.fixture(scope="module")
def tiny_factory():
    def make(**cfg):
        return LLMEngine(model="dummy:tiny", device="cpu", **cfg)
    return make


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), prefix=st.booleans(), chunked=st.booleans(),
       blocks=st.integers(12, 40), budget=st.sampled_from([8, 32, 256]), multi=st.sampled_from([1, 3]))
def test_random_workload_frees_every_block(tiny_factory, seed, prefix, chunked, blocks, budget, multi):
    rng = random.Random(seed)
    eng = tiny_factory(num_kv_blocks=blocks, block_size=4, enable_prefix_caching=prefix,
                       enable_chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else 256,
                       max_num_seqs=rng.randint(1, 8), max_model_len=min(blocks - 1, 63) * 4,
                       num_scheduler_steps=multi)   # multi-step blocks pipelined behind each other
    shared = [rng.randrange(49152) for _ in range(rng.randint(0, 20))]
    live = []
    for step in range(60):
        if rng.random() < 0.4:
            n = rng.randint(1, 30)
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(49152) for _ in range(n)]
            sp = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True,
                                temperature=rng.choice([0, 1.0]), seed=rng.choice([None, 7]))
            try:
                live.append(eng.add_request(prompt, sp))
            except ValueError as e:   # too long for this tiny pool: refused up front
                assert "max_tokens" in str(e) or "prompt" in str(e)
        if live and rng.random() < 0.15:
            eng.abort_request(live.pop(rng.randrange(len(live))))
        eng.step()
        check_block_invariants(eng)
    while eng.has_unfinished_requests():
        eng.step()
        check_block_invariants(eng)
    pool = eng.block_manager.pool
    assert all(r == 0 for r in pool.ref_counts)
    assert pool.num_free == blocks - 1            # free + cached-free = the whole usable pool
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.seqs


def _seq(tokens, rid="r"):
    return Sequence(rid, None, tokens, SamplingParams(), 0.0)


def _admit(bm, seq):
    bm.match_prefix(seq)
    bm.record_admission(seq)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed(seq)
    seq.admitted = True


def test_prefix_sharing_exact_accounting():
    bm = BlockManager(num_blocks=32, block_size=16, enable_prefix_caching=True)
    common = list(range(100, 148))                      # three full blocks
    a = _seq(common + [1, 2, 3], "a")
    _admit(bm, a)
    b = _seq(common + [9, 9, 9, 9], "b")
    _admit(bm, b)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 48
    assert b.block_table[:3] == a.block_table[:3]
    assert [bm.pool.ref_counts[x] for x in a.block_table[:3]] == [2, 2, 2]
    c = _seq(common[:40], "c")                          # ends mid-block: only the 2 full blocks are shared
    _admit(bm, c)
    assert c.num_cached_tokens == 32
    d = _seq(common, "d")                               # exactly 3 blocks: the last token must be computed
    _admit(bm, d)
    assert d.num_cached_tokens == 32
    assert bm.total_hits == 48 + 32 + 32


def test_lru_eviction_order_and_evicted_never_reused():
    bm = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=True)   # 4 usable blocks
    x = _seq([1, 2, 3, 4, 5], "x")     # blocks for [1,2], [3,4], [5]
    _admit(bm, x)
    b1, b2 = x.block_table[0], x.block_table[1]
    bm.free(x)
    bm.pool.pop_journal()
    y = _seq([7, 8, 9, 10, 11], "y")   # 3 blocks: the 2 uncached free ones first, then the LRU cached one
    _admit(bm, y)
    # x freed tail-first, so [3,4] (b2) is least recently used and [1,2] (b1) most recently used
    assert bm.pool.pop_journal()[2] == [b2]
    assert bm.pool.hash_to_block.get(x.block_hashes[1]) is None
    assert bm.pool.hash_to_block.get(x.block_hashes[0]) == b1
    bm.free(y)
    z = _seq([1, 2, 3, 4, 6], "z")     # [1,2] still cached, [3,4] was evicted: only 2 tokens hit
    _admit(bm, z)
    assert z.num_cached_tokens == 2


_ALONE: dict[tuple, list[int]] = {}


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), blocks=st.sampled_from([12, 256]), steps=st.sampled_from([2, 4]))
def test_arrivals_behind_blocks_in_flight_get_their_tokens(tiny_factory, seed, blocks, steps):
    """Greedy requests arriving at random steps while decode blocks are in flight (admitted by mixed steps behind
    them, or by synchronous steps when a pool of 12 blocks preempts), some aborted: every request that finishes
    has the tokens it gets alone, and no block stays held."""
    rng = random.Random(seed)
    eng = tiny_factory(num_kv_blocks=blocks, block_size=4, num_scheduler_steps=steps, max_num_seqs=6)
    pending = [([rng.randrange(49152) for _ in range(rng.randint(1, 12))], rng.randint(1, 12)) for _ in range(8)]
    for prompt, n in pending:
        if (tuple(prompt), n) not in _ALONE:
            alone = tiny_factory(num_kv_blocks=64, block_size=4)
            _ALONE[(tuple(prompt), n)] = run_requests(
                alone, [prompt], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)])[0].token_ids
    ids, done, aborted = {}, {}, set()
    while pending or eng.has_unfinished_requests():
        if pending and rng.random() < 0.4:
            prompt, n = pending.pop(0)
            ids[eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))] = (prompt, n)
        if ids and rng.random() < 0.05:
            rid = rng.choice(list(ids))
            if rid not in done and rid not in aborted:
                eng.abort_request(rid)
                aborted.add(rid)
        for o in eng.step():
            if o.finished and o.request_id not in aborted:
                done[o.request_id] = o
        check_block_invariants(eng)
    assert {rid: done[rid].token_ids for rid in ids if rid not in aborted} == \
        {rid: _ALONE[(tuple(p), n)] for rid, (p, n) in ids.items() if rid not in aborted}
    assert eng.block_manager.pool.num_free == blocks - 1
