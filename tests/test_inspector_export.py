"""inspector.export: metrics CSV and Chrome-trace JSON from recorded (synthetic) events."""
import io
import json

import pandas as pd
import pytest

from inspector import export as X
from inspector.recorder import Recorder
from inspector.synthetic import simulate


@pytest.fixture(scope="module")
def snap():
    run = simulate(num_requests=12, seed=0, num_blocks=20, output_len=(10, 30))
    rec = Recorder()
    run.feed(rec)
    return rec.snapshot(kv=run.kv)


def test_metrics_csv_roundtrip(snap, tmp_path):
    text = X.metrics_csv(snap.records, tmp_path / "m.csv")
    df = pd.read_csv(io.StringIO(text))
    assert len(df) == len(snap.records) == 12
    for col in ("request_id", "ttft_ms", "tpot_ms", "e2el_ms", "mean_itl_ms", "prompt_len", "output_len",
                "num_preemptions"):
        assert col in df.columns
    r = snap.records[0]
    row = df.set_index("request_id").loc[r.request_id]
    assert row.ttft_ms == pytest.approx((r.metrics.first_token_time - r.metrics.arrival_time) * 1000)
    assert (tmp_path / "m.csv").read_text() == text


def test_steps_frame(snap):
    df = X.steps_frame(snap)
    assert len(df) == len(snap.steps)
    assert {"duration_ms", "prefill_tokens", "decode_tokens", "kv_usage", "t_attention_ms"} <= set(df.columns)


def test_chrome_trace_structure(snap, tmp_path):
    text = X.chrome_trace_json(snap, tmp_path / "t.json")
    tr = json.loads(text)
    ev = tr["traceEvents"]
    assert tr["displayTimeUnit"] == "ms"
    for e in ev:
        assert {"name", "ph", "pid"} <= set(e)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and "ts" in e and "tid" in e
    steps = [e for e in ev if e["ph"] == "X" and e.get("cat") == "step"]
    assert len(steps) == len(snap.steps)
    ts = [e["ts"] for e in steps]
    assert ts == sorted(ts) and ts[0] >= 0
    regions = [e for e in ev if e.get("cat") == "region" and e["tid"] == 1]
    # top-level regions of a step lie inside it
    s0 = steps[0]
    inside = [r for r in regions if s0["ts"] <= r["ts"] < s0["ts"] + s0["dur"] + 1e-3]
    assert {r["name"] for r in inside} >= {"schedule", "forward", "sampling"}
    assert sum(r["dur"] for r in inside) <= s0["dur"] + 1e-3
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2}
    assert names == {r.request_id for r in snap.requests}
    phases = {e["cat"] for e in ev if e["ph"] == "X" and e["pid"] == 2}
    assert {"prefill", "decode"} <= phases
    assert any(e["ph"] == "C" and e["name"] == "KV usage" for e in ev)
