"""The host KV tier's bookkeeping under random workloads (hypothesis): preemption by swap or recompute, aborts,
prefix-cache evictions to the host LRU and fetches back. A fake device replays each step's block copies (out,
then in) and writes each scheduled token into its slot, so the test checks what the kernels would read: every
scheduled request's blocks hold exactly its tokens, and no block is lost or owned twice in either tier."""
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.config import EngineConfig
from engine.core.kv_cache_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams

BS = 4


class FakeDevice:
    """Slot contents (token ids, None: never written) of the device pool and the host tier."""

    def __init__(self, num_blocks: int, num_host: int):
        self.dev = [[None] * BS for _ in range(num_blocks)]
        self.host = [[None] * BS for _ in range(num_host)]

    def run(self, out) -> None:
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.dev[d])
        for h, d in out.blocks_to_swap_in:
            self.dev[d] = list(self.host[h])
        for seq, n, start in zip(out.seqs, out.num_new_tokens, out.computed_before):
            for p in range(start, start + n):
                self.dev[seq.block_table[p // BS]][p % BS] = seq.token_ids[p]

    def check(self, seq: Sequence, upto: int) -> None:
        for p in range(upto):
            assert self.dev[seq.block_table[p // BS]][p % BS] == seq.token_ids[p], (seq.request_id, p)


def check_accounting(bm: BlockManager, seqs: list[Sequence]) -> None:
    live = [s for s in seqs if s.status is not SequenceStatus.FINISHED]
    refs = Counter(b for s in live for b in s.block_table)
    pool = bm.pool
    for b in range(1, pool.num_blocks):
        assert pool.ref_counts[b] == refs[b], b                   # every reference is a table entry
        assert (b in pool.free) == (refs[b] == 0), b              # free exactly when unreferenced
    assert 0 not in refs and 0 not in pool.free
    for s in live:
        assert not (s.block_table and s.host_block_table)
        if s.status is SequenceStatus.RUNNING:
            assert not s.host_block_table
    host = bm.host
    owned = Counter(h for s in live for h in s.host_block_table)
    assert all(c == 1 for c in owned.values())                    # a host block has one owner
    assert set(owned) == host.owned
    cached = set(host.cached.values())
    assert len(cached) == len(host.cached) and set(host.block_hash) == cached
    parts = [set(host.free), host.owned, cached]
    assert sum(map(len, parts)) == host.num_blocks                # free, owned, cached: a partition
    assert set().union(*parts) == set(range(host.num_blocks))
    assert not host.pinned and not bm._host_to_free               # pins last one step


def make(num_blocks, num_host, mode, prefix):
    cfg = EngineConfig(model="dummy:tiny", device="cpu", block_size=BS, max_num_batched_tokens=32, max_num_seqs=6,
                       num_kv_blocks=num_blocks, kv_offload_gib=0.001, preemption_mode=mode)
    bm = BlockManager(num_blocks, BS, prefix, num_host_blocks=num_host)
    return Scheduler(cfg, bm, max_model_len=num_blocks * BS), bm


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(["swap", "recompute", "auto"]),
       num_blocks=st.integers(6, 14), num_host=st.integers(1, 12), prefix=st.booleans())
def test_tiers_keep_every_block_and_its_contents(seed, mode, num_blocks, num_host, prefix):
    rng = random.Random(seed)
    sch, bm = make(num_blocks, num_host, mode, prefix)
    dev = FakeDevice(num_blocks, num_host)
    shared = [rng.randrange(50) for _ in range(2 * BS)]          # prefixes repeat: cache hits, evictions, fetches
    seqs, n = [], 0
    for step in range(60):
        if rng.random() < 0.4 and n < 14:
            prompt = (shared[:rng.choice([0, BS, 2 * BS])] + [rng.randrange(50) for _ in range(rng.randrange(1, 10))])
            max_len = min(len(prompt) + rng.randrange(1, 10), (num_blocks - 1) * BS)
            seq = Sequence(f"r{n}", None, prompt[:max_len - 1], SamplingParams(max_tokens=max_len), 0.0)
            seq.max_len = max_len
            sch.add(seq)
            seqs.append(seq)
            n += 1
        if rng.random() < 0.08:                                   # an abort, waiting (maybe swapped) or running
            live = [s for s in seqs if s.status is not SequenceStatus.FINISHED]
            if live:
                sch.finish(rng.choice(live), "abort")
        out = sch.schedule()
        dev.run(out)
        for seq, k, start in zip(out.seqs, out.num_new_tokens, out.computed_before):
            dev.check(seq, start + k)                             # what attention reads this step
        for seq, k in zip(out.seqs, out.num_new_tokens):          # the step computed them; decodes sample
            seq.num_computed_tokens += k
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(50))
            bm.commit_computed(seq)
            if seq.num_tokens >= seq.max_len:
                sch.finish(seq, "length")
        check_accounting(bm, seqs)
    for s in seqs:
        if s.status is not SequenceStatus.FINISHED:
            sch.finish(s, "abort")
    check_accounting(bm, seqs)
    assert bm.pool.num_free == num_blocks - 1 and not bm.host.owned


def test_swap_keeps_computed_tokens_and_recompute_drops_them():
    for mode, kept in (("swap", True), ("recompute", False)):
        sch, bm = make(6, 8, mode, prefix=False)
        a = Sequence("a", None, list(range(9)), SamplingParams(max_tokens=20), 0.0)
        b = Sequence("b", None, list(range(100, 109)), SamplingParams(max_tokens=20), 0.0)
        for s in (a, b):
            sch.add(s)
        out = sch.schedule()
        for s, k in zip(out.seqs, out.num_new_tokens):
            s.num_computed_tokens += k
            s.append_token(1)
        # both need a 4th block of 4 tokens soon: the pool (5 usable) cannot hold 2 x 3 + growth
        while not sch.num_preemptions:
            out = sch.schedule()
            for s, k in zip(out.seqs, out.num_new_tokens):
                s.num_computed_tokens += k
                s.append_token(1)
        victim = next(s for s in (a, b) if s.status is SequenceStatus.WAITING)
        assert bool(victim.host_block_table) == kept
        assert (victim.num_computed_tokens == victim.num_tokens - 1) == kept
        assert (victim.num_computed_tokens == 0) == (not kept)


def test_cost_model_swaps_when_copying_is_cheaper_than_prefilling():
    from engine.core.scheduler import SwapCostModel
    m = SwapCostModel(block_bytes=1 << 20, copy_bytes_per_s=1e9, prefill_tokens_per_s=1000.0)
    # 16 blocks out and back: 2 * 16 MiB at 1 GB/s = 33.6 ms; 256 tokens at 1000 tok/s = 256 ms
    assert m.prefer_swap(num_tokens=256, num_blocks=16)
    assert not m.prefer_swap(num_tokens=16, num_blocks=16)      # 16 ms of prefill beats 33.6 ms of copies
    m.observe(1000, 0.01)                                         # the device prefills faster than assumed
    assert m.prefill_tokens_per_s == 0.8 * 1000 + 0.2 * 100000
    assert not m.prefer_swap(num_tokens=256, num_blocks=16)
    m.observe(8, 1.0)                                             # a decode step says nothing about prefill
    assert m.prefill_tokens_per_s == 0.8 * 1000 + 0.2 * 100000


def test_tier_config_is_checked():
    with pytest.raises(ValueError, match="kv_offload_gib"):
        EngineConfig(kv_offload_gib=-1)
    with pytest.raises(ValueError, match="kv_offload_gib: needs the paged KV cache"):
        EngineConfig(kv_offload_gib=1, kv_cache_layout="contiguous")
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.slow
def test_engine_swaps_are_in_events_tracks_and_block_map():
    from engine import LLMEngine
    from engine.events import StepEvent
    from inspector.figures.blocks import block_map_spec
    from inspector.tracks import TrackBuilder
    from helpers import add_random_requests
    eng = LLMEngine(model="dummy:tiny", device="cpu", kernels="torch", block_size=4, num_kv_blocks=12,
                    enable_prefix_caching=False, kv_offload_gib=0.001, preemption_mode="swap", kv_cache_dtype="fp8")
    events, tracks, snaps = [], TrackBuilder(100, 1000), []
    eng.events.subscribe(events.append)
    add_random_requests(eng, [9, 16, 23, 30], max_tokens=12, vocab=eng.arch_config.vocab_size)
    while eng.has_unfinished_requests():
        eng.step()
        if eng.block_manager.host.owned and not snaps:
            snaps.append(eng.kv_snapshot())
    for ev in events:
        (tracks.on_step if isinstance(ev, StepEvent) else tracks.on_request)(ev)
    steps = [e for e in events if isinstance(e, StepEvent)]
    out = [e for e in steps if e.swapped_out]
    assert out and eng.scheduler.num_swaps == sum(len(e.swapped_out) for e in steps)
    block_bytes = eng.slot_bytes * 4
    assert sum(e.bytes_swapped_out for e in steps) == eng.block_manager.swap_stats["swapped_out"] * block_bytes
    assert sum(e.bytes_swapped_in for e in steps) == eng.block_manager.swap_stats["swapped_in"] * block_bytes > 0
    rid = out[0].swapped_out[0]
    spans = tracks.tracks[rid].copy(1e9, 1e9).spans
    assert "swapped" in [sp.phase for sp in spans]
    assert any(sp.note.startswith("swapped in") for sp in spans)
    snap = snaps[0]
    assert snap["kv_format"] == "float8_e4m3fn" and snap["host"]["block_tables"]
    fig = block_map_spec(snap)
    assert [d.get("name") for d in fig["data"]][:2] == ["blocks", "host tier"]
    assert "fp8 e4m3" in fig["layout"]["title"]["text"] or "fp8 e4m3" in str(fig["layout"])
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1 and not eng.block_manager.host.owned


def test_prefixes_fetched_from_the_host_tier_give_the_same_tokens(tmp_path):
    from engine import LLMEngine
    from helpers import check_no_leak, multi_turn_tokens, save_random_llama
    save_random_llama(tmp_path, seed=3, layers=2)                # its tokens depend on the context (dummy:tiny's don't)
    runs = {}
    for name, extra in (("no tier", {}), ("host tier", dict(kv_offload_gib=0.01))):
        eng = LLMEngine(model=str(tmp_path), device="cpu", kernels="torch", dtype="float32", block_size=4,
                        num_kv_blocks=24, max_model_len=88, **extra)
        runs[name] = multi_turn_tokens(eng, users=3, turns=3, turn_len=17, answer=6)
        runs[name + " stats"] = eng.stats()
        check_no_leak(eng)
        eng.close()
    assert runs["host tier"] == runs["no tier"]
    assert runs["host tier stats"]["fetched"] > 0 and runs["host tier stats"]["offloaded"] > 0
