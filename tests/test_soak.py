"""The soak test, short (the long soak is benchmarks/soak.py): `python app.py` (UI + API in one process) under 4 HTTP users mixing good streams,
chats, mid-stream disconnects, cancellations, bad and over-long requests, with a small KV pool so requests
also get preempted. The verdicts count outcomes, not speed: every good request has its exact length, every
bad one a 4xx, no 5xx, no KV block in use once idle, RSS flat after warm-up."""
import csv

import pytest

from benchmarks import soak

pytestmark = pytest.mark.slow


def test_soak_short(tmp_path):
    # a 3 s closed-loop capacity probe of 4 users, then 9 s open loop at 70% of it from two client processes;
    # TTFT drift is a speed verdict, left to the long soak (--ttft-drift inf)
    args = soak.parse_args(["--load-frac", "0.7", "--probe-s", "3", "--duration", "9", "--users", "4", "--procs", "2",
                            "--model", "dummy:tiny",
                            "--sample-s", "1", "--set", "num_kv_blocks=24", "--no-png", "--set", "max_num_seqs=8",
                            "--ttft-drift", "inf", "--out", str(tmp_path)])
    res = soak.run_soak(args)
    rc = soak.report(res, tmp_path, args)
    assert res["checks"] and all(res["checks"].values()), (res["checks"], res["failures"])
    assert rc == 0
    cap = res["capacity"]
    assert cap["requests_per_s"] > 0 and res["rate_per_s"] == round(0.7 * cap["requests_per_s"], 2)
    assert cap["failed"] == 0 and res["http_5xx_during"] == 0
    assert res["requests"] > 0 and res["users"] is None
    for action in ("stream", "bad", "too_long", "disconnect", "cancel"):
        assert res["sent"][action] > 0, action
    assert res["final"]["kv_blocks_in_use"] == 0 and res["final"]["num_requests_running"] == 0
    rows = list(csv.DictReader(open(tmp_path / "soak.csv")))
    assert len(rows) >= 8
    assert max(float(r["kv_blocks_in_use"]) for r in rows) > 0        # the sampler saw the pool in use
    assert float(rows[-1]["kv_blocks_in_use"]) == 0
    # the clients' side, merged from both processes: outcomes so far and the streams' TTFT per window
    assert int(float(rows[-1]["good_ok"])) == res["ok"]["stream"] + res["ok"]["chat"]
    ttfts = [float(r["ttft_p99_ms"]) for r in rows if r["ttft_p99_ms"]]
    assert len(ttfts) >= 5 and all(t > 0 for t in ttfts)
    assert res["ttft_p99_ms_early"] and res["ttft_p99_ms_late"]
    assert (tmp_path / "soak.html").stat().st_size > 1000
    (tmp_path / "soak.html").unlink()
    assert soak.main(["--replot", str(tmp_path), "--no-png"]) == 0          # drawn again from the CSV + JSON
    assert (tmp_path / "soak.html").stat().st_size > 1000


def test_soak_engine_core_killed(tmp_path):
    """The API server (engine in its own process) with its engine core SIGKILLed 3 s in: requests caught by it
    get a clear engine error (503 or a stream error event), only around the restart; after it, good requests are
    served again; no other 5xx; no KV block in use at the end."""
    args = soak.parse_args(["--server", "api", "--kill-core-at", "3", "--after-restart-s", "3", "--duration", "6", "--users", "4",
                            "--model", "dummy:tiny", "--sample-s", "1", "--set", "num_kv_blocks=48", "--no-png",
                            "--out", str(tmp_path)])
    res = soak.run_soak(args)
    soak.report(res, tmp_path, args)
    assert res["checks"] and all(res["checks"].values()), (res["checks"], res["failures"], res["kill_core"])
    assert res["kill_core"]["new_pid"] != res["kill_core"]["killed_pid"]
    assert all(e[2].startswith("engine:") for e in res["engine_errors"])
