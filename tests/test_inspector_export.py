"""inspector.export: metrics CSV and Chrome-trace JSON from events recorded on a real tiny CPU engine (conftest's
engine_run), every value checked against the engine's outputs and events."""
import io
import json

import pandas as pd
import pytest

from inspector import export as X


@pytest.fixture(scope="module")
def snap(engine_run):
    return engine_run.snapshot()


def ms(x):
    return pytest.approx(x * 1000, rel=1e-9, abs=1e-9)


def test_metrics_csv_roundtrip(engine_run, snap, tmp_path):
    text = X.metrics_csv(snap.records, tmp_path / "m.csv")
    assert (tmp_path / "m.csv").read_text() == text
    df = pd.read_csv(io.StringIO(text)).set_index("request_id")
    assert len(df) == len(snap.records) == len(engine_run.outputs) == 24
    assert set(df.index) == set(engine_run.outputs)
    finished = {e.request_id: e for e in engine_run.request_events("finished")}
    for rid, out in engine_run.outputs.items():
        row, m = df.loc[rid], out.metrics
        assert row.prompt_len == len(out.prompt_token_ids) == finished[rid].prompt_len
        assert row.output_len == len(out.token_ids) == finished[rid].output_len
        assert row.finish_reason == out.finish_reason == "length"
        assert row.num_preemptions == m.num_preemptions
        assert row.num_cached_tokens == m.num_cached_tokens
        assert row.ttft_ms == ms(out.ttft)
        assert row.tpot_ms == ms(out.tpot)
        assert row.e2el_ms == ms(m.finished_time - m.arrival_time)
        assert row.queue_time_ms == ms(m.first_scheduled_time - m.arrival_time)
        tt = m.token_times
        assert row.mean_itl_ms == ms((tt[-1] - tt[0]) / (len(tt) - 1))
    # the workload's shape shows in the numbers: prefix-cache hits and preemptions on the small pool
    assert (df.num_cached_tokens > 0).any()
    assert df.num_preemptions.sum() == sum(len(s.preempted) for s in engine_run.steps) > 0


def test_steps_frame(engine_run, snap):
    df = X.steps_frame(snap)
    steps = engine_run.steps
    assert len(df) == len(steps)
    assert {"duration_ms", "prefill_tokens", "decode_tokens", "kv_usage", "t_attention_ms"} <= set(df.columns)
    for (_, row), s in zip(df.iterrows(), steps):
        assert row.step == s.step
        assert row.start_s == pytest.approx(s.start - snap.t0, abs=1e-12)
        assert row.duration_ms == ms(s.end - s.start)
        assert (row.num_seqs, row.prefill_tokens, row.decode_tokens) == \
            (len(s.scheduled), s.num_prefill_tokens, s.num_decode_tokens)
        assert (row.running, row.waiting, row.preempted, row.finished) == \
            (s.num_running, s.num_waiting, len(s.preempted), len(s.finished))
        assert row.kv_usage == s.kv_usage
        assert (row.prefix_cache_queries, row.prefix_cache_hits) == (s.prefix_cache_queries, s.prefix_cache_hits)
        assert row.t_attention_ms == ms(s.timings["attention"])
    assert df.prefill_tokens.sum() + df.decode_tokens.sum() == \
        sum(r.num_tokens for s in steps for r in s.scheduled)


def test_chrome_trace_structure(engine_run, snap, tmp_path):
    text = X.chrome_trace_json(snap, tmp_path / "t.json")
    assert (tmp_path / "t.json").read_text() == text
    tr = json.loads(text)
    ev = tr["traceEvents"]
    assert tr["displayTimeUnit"] == "ms"
    for e in ev:
        assert {"name", "ph", "pid"} <= set(e)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and "ts" in e and "tid" in e
    steps = [e for e in ev if e["ph"] == "X" and e.get("cat") == "step"]
    assert len(steps) == len(engine_run.steps)
    ts = [e["ts"] for e in steps]
    assert ts == sorted(ts) and ts[0] >= 0
    for e, s in zip(steps, engine_run.steps):
        assert e["name"] == f"step {s.step}"
        assert e["ts"] == pytest.approx((s.start - snap.t0) * 1e6, abs=1e-3)
        assert e["dur"] == pytest.approx((s.end - s.start) * 1e6, abs=1e-3)
        a = e["args"]
        assert (a["prefill_tokens"], a["decode_tokens"], a["running"], a["waiting"]) == \
            (s.num_prefill_tokens, s.num_decode_tokens, s.num_running, s.num_waiting)
        assert a["preempted"] == s.preempted and a["finished"] == s.finished
        assert a["requests"] == [f"{r.request_id}:{r.phase}:{r.num_tokens}" for r in s.scheduled]
    kv = [e["args"]["%"] for e in ev if e["ph"] == "C" and e["name"] == "KV usage"]
    assert kv == [round(100 * s.kv_usage, 2) for s in engine_run.steps]
    regions = [e for e in ev if e.get("cat") == "region" and e["tid"] == 1]
    # top-level regions of a step lie inside it, in execution order
    s0 = steps[0]
    inside = [r for r in regions if s0["ts"] <= r["ts"] < s0["ts"] + s0["dur"] + 1e-3]
    assert [r["name"] for r in inside] == [k for k in X._TOP_ORDER if k in engine_run.steps[0].timings]
    assert {r["name"] for r in inside} >= {"schedule", "forward", "sampling"}
    assert sum(r["dur"] for r in inside) <= s0["dur"] + 1e-3
    # one track per request, its spans and finish from the engine
    tids = {e["args"]["name"]: e["tid"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"
            and e["pid"] == 2}
    assert set(tids) == {r.request_id for r in snap.requests} == set(engine_run.outputs)
    phases = {e["cat"] for e in ev if e["ph"] == "X" and e["pid"] == 2}
    assert {"prefill", "decode", "preempted"} <= phases
    for rid, out in engine_run.outputs.items():
        mine = [e for e in ev if e["pid"] == 2 and e.get("tid") == tids[rid] and e["ph"] in ("X", "i")]
        (fin,) = [e for e in mine if e["ph"] == "i"]
        assert fin["args"] == dict(finish_reason="length", output_len=len(out.token_ids),
                                   preemptions=out.metrics.num_preemptions)
        assert sum(e["cat"] == "preempted" for e in mine if e["ph"] == "X") == out.metrics.num_preemptions
