"""The inspector against the real engine (random-weight tiny model, CPU): recorder spans, metrics from the
engine's stamps, block map vs kv_snapshot, preemption on a small pool, simulated users, profiling."""
import math

import pytest

from engine import EngineConfig, SamplingParams
from engine.runtime.async_engine import EngineLoop
from inspector import figures as F
from inspector import load as L
from inspector import metrics as M
from inspector.profile import profile_one_step
from inspector.recorder import Recorder


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=24, max_num_seqs=8)) as lp:
        yield lp


@pytest.fixture
def rec(loop):
    r = Recorder().attach(loop.engine.events)
    yield r
    r.detach()


def test_stream_metrics_and_spans_match_engine_stamps(loop, rec):
    out = loop.submit([100 + i for i in range(20)], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                      request_id="one").result(30)
    rec.record_output(out)
    snap = rec.snapshot(kv=loop.kv_snapshot())
    (r,) = [x for x in snap.requests if x.request_id == "one"]
    # the front end's hand-over (submit -> the engine's waiting queue) comes first, then the engine's phases
    assert r.spans[0].phase == "frontend" and r.spans[0].start == out.metrics.arrival_time
    phases = [s.phase for s in r.spans[1:]]
    assert phases[:3] == ["waiting", "prefill", "decode"] or phases[:2] == ["prefill", "decode"]
    assert r.status == "finished" and r.prompt_len == 20
    s = M.summarize(snap.records)
    m = out.metrics
    assert s["TTFT"]["mean"] == pytest.approx((m.first_token_time - m.arrival_time) * 1e3)
    assert s["TPOT"]["mean"] == pytest.approx(out.tpot * 1e3)
    assert s["ITL"]["n"] == 5
    # prefill ends where the first token is stamped (same clock, same step)
    pre = [x for x in r.spans if x.phase == "prefill"][0]
    assert pre.start <= m.first_token_time and abs(pre.end - m.first_token_time) < 0.05


def test_load_runner_drives_the_engine_and_block_map_reflects_it(loop, rec):
    spec = L.LoadSpec(num_requests=8, rate=math.inf, prompt_len=L.LengthDist("uniform", 8, 24),
                      output_len=L.LengthDist("fixed", 12, 12), seed=3)
    runner = L.LoadRunner(loop, spec, recorder=rec).start()
    seen_owner = None
    while not runner.wait(0.005):
        kv = loop.kv_snapshot()
        if kv["block_tables"] and seen_owner is None:
            seen_owner = kv
    assert runner.progress()["finished"] == 8
    s = runner.summary()
    assert s["completed"] == 8 and s["output_tokens"] == 96
    snap = rec.snapshot(kv=seen_owner)
    ids = {f"L{runner.run_id}-{i:03d}" for i in range(8)}
    assert ids <= {r.request_id for r in snap.requests}
    tl = F.timeline_spec(snap)
    decode = [t for t in tl["data"] if t.get("name") == "decode"][0]
    assert ids <= set(decode["y"])
    if seen_owner is not None:                 # the block map showed load requests owning blocks
        bm = F.block_map_spec(seen_owner)
        text = " ".join(sum(bm["data"][0]["text"], []))
        assert f"L{runner.run_id}-" in text
        st = F.block_states(seen_owner)
        assert st["num_in_use"] == sum(1 for c in seen_owner["ref_counts"] if c > 0)
    # after the load every block is back: free or cached-free
    st = F.block_states(loop.kv_snapshot())
    assert st["num_in_use"] == 0


def test_preemption_on_a_small_pool_shows_in_timeline_and_metrics(loop, rec):
    # each sequence grows to 16 + 160 tokens = 11 blocks of 23 usable: any 3 running at once overflow the
    # pool, and 160 decode steps per request leave the load generator ample time to submit all 8
    spec = L.LoadSpec(num_requests=8, rate=math.inf, prompt_len=L.LengthDist("fixed", 16, 16),
                      output_len=L.LengthDist("fixed", 160, 160), seed=5)
    runner = L.LoadRunner(loop, spec, recorder=rec).start()
    assert runner.wait(120)
    s = runner.summary()
    assert s["completed"] == 8 and s["preemptions"] > 0
    snap = rec.snapshot()
    assert snap.totals["preemptions"] == s["preemptions"]
    pre = [r for r in snap.requests if r.num_preemptions]
    assert pre and any(sp.phase == "preempted" for r in pre for sp in r.spans)
    # the span after each preemption says how it resumed (recomputed, or its own blocks still cached)
    assert all(any(sp.note in ("recompute", "resumed from prefix cache") for sp in r.spans) for r in pre)
    tl = F.timeline_spec(snap, axis="step")
    assert [t for t in tl["data"] if t.get("name") == "preempted"][0]["y"]


def test_profile_one_step_while_running(loop):
    stream = loop.submit([200 + i for i in range(8)], SamplingParams(max_tokens=200, ignore_eos=True))
    try:
        rows = profile_one_step(loop, timeout=30)
    finally:
        stream.cancel()
    assert rows and all("name" in r for r in rows)
    spec = F.profile_spec(rows)
    assert spec["data"][0]["x"][0] >= 0
