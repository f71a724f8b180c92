"""The load generator's HTTP target: seeded workloads sent to the OpenAI-compatible server over the wire."""
import math
import time

import pytest

from engine import EngineConfig
from engine.runtime.async_engine import EngineLoop
from inspector import metrics as M
from inspector.http_load import HttpLoadRunner, HttpTarget, format_progress, run_http_load
from inspector.load import LengthDist, LoadSpec, build_workload
from helpers import wait_idle


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=1024,
                                 max_num_seqs=8, max_waiting_requests=6)) as lp:
        yield lp


def test_records_match_the_workload(srv, loop):
    spec = LoadSpec(name="http", num_requests=8, rate=40.0, prompt_len=LengthDist("fixed", 24, 24),
                    output_len=LengthDist("uniform", 4, 9), seed=3)
    runner = HttpLoadRunner(srv.url, spec).start()
    assert runner.wait(60)
    assert not runner.errors and runner.model == "dummy:tiny"
    _, items = build_workload(spec, runner.vocab_size)
    recs = sorted(runner.records, key=lambda r: r.request_id)
    assert [r.output_len for r in recs] == [it.max_tokens for it in items]
    assert all(r.prompt_len == 24 and r.finish_reason == "length" for r in recs)
    for r in recs:
        m = r.metrics
        assert m.arrival_time < m.first_token_time <= m.last_token_time <= m.finished_time
        # one stamp per streamed chunk: a chunk carries one token, or several when the stream fell behind
        assert 1 <= len(m.token_times) <= r.output_len
        assert m.token_times == sorted(m.token_times)
        assert (m.token_times[0], m.token_times[-1]) == (m.first_token_time, m.last_token_time)
    s = runner.summary()
    assert s["completed"] == 8 and s["failed"] == 0 and s["http_status"] == {"200": 8}
    assert s["TTFT"]["n"] == 8 and s["ITL"]["n"] == sum(len(r.metrics.token_times) - 1 for r in recs)
    assert M.summary_table(s)["Metric"].iloc[0] == "TTFT (ms)"
    assert "8/8 finished" in format_progress(runner.progress())
    assert runner.progress()["http_status"] == {"200": 8}       # JSON-safe (the app sends it to browsers)
    wait_idle(loop)


def test_multi_turn_resends_the_conversation(srv, loop):
    spec = LoadSpec(name="chat", num_requests=4, rate=50.0, num_turns=2, prompt_len=LengthDist("fixed", 10, 10),
                    output_len=LengthDist("fixed", 5, 5), seed=1)
    recs = run_http_load(HttpTarget(srv.url + "/v1"), spec, timeout=60)
    lens = sorted(r.prompt_len for r in recs)
    assert lens == [10, 10, 25, 25]                         # turn 2 = turn 1 prompt + reply + new tokens
    wait_idle(loop)


def test_flood_counts_503s_and_stop_cancels(srv, loop):
    spec = LoadSpec(name="flood", num_requests=30, rate=math.inf, prompt_len=LengthDist("fixed", 8, 8),
                    output_len=LengthDist("fixed", 6, 6), seed=2)
    runner = HttpLoadRunner(srv.url, spec).start()
    assert runner.wait(60)
    s = runner.summary()
    assert s["http_status"].get("503", 0) > 0 and s["completed"] + s["http_status"]["503"] == 30
    assert all(r.output_len == 6 for r in runner.records)
    wait_idle(loop)

    long = LoadSpec(name="long", num_requests=4, rate=math.inf, prompt_len=LengthDist("fixed", 8, 8),
                    output_len=LengthDist("fixed", 900, 900), seed=2)
    runner = HttpLoadRunner(srv.url, long).start()
    t_end = time.monotonic() + 10
    while loop.stats()["num_running"] < 1 and time.monotonic() < t_end:
        time.sleep(0.01)
    runner.stop()
    assert runner.wait(10) and runner.stopped
    assert runner.progress()["in_flight"] == 0
    wait_idle(loop)                                          # closed connections -> aborted -> blocks freed


def test_bad_target():
    with pytest.raises(ValueError, match="base URL"):
        HttpTarget("localhost:8000")
    with pytest.raises(ValueError, match="tokenizer"):
        HttpTarget("http://127.0.0.1:1", endpoint="chat")


@pytest.mark.slow
def test_sharded_client_sends_the_same_workload_from_several_processes(srv, loop):
    """bench_serve's --client-procs: the workload split by user over client processes that start at one
    instant (connections opened ahead) gives the same requests as one process, and every arrival is
    stamped at or after the agreed start."""
    from benchmarks.serve_client import make_spec, run_sharded
    kw = dict(num_prompts=6, request_rate=math.inf, burstiness=1.0, max_concurrency=None, input_len=12,
              output_len=4, range_ratio=0.5, seed=5)
    res = run_sharded(srv.url, None, None, kw, 1000, n=2, timeout=120, warm=True)
    assert not res["errors"] and res["failed"] == 0 and res["http_status"] == {"200": 6}
    _, items = build_workload(make_spec(**kw), 1000)
    assert sorted(r.output_len for r in res["records"]) == sorted(it.max_tokens for it in items)
    assert sorted(r.prompt_len for r in res["records"]) == sorted(len(it.new_tokens) for it in items)
    assert all(res["t_start"] <= r.metrics.arrival_time < r.metrics.first_token_time <= r.metrics.finished_time
               for r in res["records"])
    wait_idle(loop)


def test_bench_serve_repeats_run_each_workload_on_fresh_prompts():
    """--repeats N: each workload N times, named apart, each on its own seed (so other prompts: a repeat never
    reads the run before it from the prefix cache); so does every workload and client of a suite."""
    from benchmarks.bench_serve import _spec, parse_args, workloads
    runs = workloads(parse_args(["--num-prompts", "4", "--request-rate", "inf", "--client-procs", "4",
                                 "--name", "burst", "--repeats", "3"]))
    assert [w.name for w in runs] == ["burst-c4-r1", "burst-c4-r2", "burst-c4-r3"]
    prompts = [[it.new_tokens for it in build_workload(_spec(w))[1]] for w in runs]
    assert all(len(p) == 4 for p in prompts)
    assert len({tuple(map(tuple, p)) for p in prompts}) == 3
    assert [w.name for w in workloads(parse_args(["--name", "burst"]))] == ["burst"]
    # a suite's workloads and clients too: the openai client's burst does not replay the aiohttp client's prompts
    suite = workloads(parse_args(["--suite", "serving-large", "--client", "aiohttp,openai"]))
    assert [w.name for w in suite] == ["burst", "burst-oai", "rate4", "rate4-oai"]
    firsts = {tuple(build_workload(_spec(w))[1][0].new_tokens) for w in suite}
    assert len(firsts) == 4
    with pytest.raises(SystemExit):
        workloads(parse_args(["--repeats", "0"]))


def test_bench_serve_reports_the_median_of_repeats():
    from benchmarks.bench_serve import repeat_medians

    def run(name, wl, tok, ttft):
        return {"name": name, "workload": wl, "output_tok_s": tok, "summary": {"TTFT": {"mean": ttft, "p99": 2 * ttft}},
                "chunks": {"gap_p99_ms": None}}
    rows = repeat_medians([run("a", "burst-c4-r1", 10.0, 5.0), run("a", "burst-c4-r2", 30.0, 1.0),
                           run("a", "burst-c4-r3", 20.0, 3.0), run("b", "burst-c4", 7.0, 1.0)])
    assert rows == [{"target": "a/burst-c4", "runs": 3, "output tok/s": 20.0, "min": 10.0, "max": 30.0,
                     "TTFT mean (ms)": 3.0, "TTFT p99 (ms)": 6.0, "chunk gap p99 (ms)": None}]


def test_chunk_gaps_leave_out_the_admission_for_the_all_started_tail():
    """The chunk-gap p99 "once every stream started" counts only gaps that begin after the last stream's first
    chunk, so stalls while a burst is still being admitted show in the whole-run tail alone."""
    from types import SimpleNamespace

    from benchmarks.bench_serve import chunk_gaps

    def rec(rid, times):
        return SimpleNamespace(request_id=rid, metrics=SimpleNamespace(token_times=times))
    early = rec("a", [1.0, 1.2, 1.4, 1.6] + [1.6 + 0.01 * k for k in range(1, 47)])   # three 200 ms stalls
    late = rec("b", [1.705] + [1.705 + 0.01 * k for k in range(1, 51)])             # the last first chunk
    gaps, chunks = chunk_gaps([early, late], t0=1.0)
    assert len(gaps) == 99 and chunks["n"] == 101 and gaps[-1] == (pytest.approx(200.0), pytest.approx(0.4), "a")
    assert chunks["gap_p99_ms"] == pytest.approx(200.0)
    assert chunks["gap_p99_all_started_ms"] == pytest.approx(10.0)
    assert chunks["gaps_all_started"] == 50 + 35                 # late's 50, early's from 1.71 on
    lone = rec("c", [1.0, 1.1, 1.3])                             # one stream: its stall comes after it started
    assert chunk_gaps([lone], t0=1.0)[1]["gap_p99_all_started_ms"] == pytest.approx(200.0)
