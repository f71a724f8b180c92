"""The serving benchmark's official-client runner: the same workload as the aiohttp runner, text chat prompts in
the served model's template, multi-turn history resent; and the trivial server its client cost is measured on."""
import asyncio
import json

import pytest

from benchmarks.openai_client import OpenAIClientRunner, trivial_app
from engine import EngineConfig
from engine.entrypoints.openai.api_server import ServerThread, build_app
from engine.runtime.async_engine import EngineLoop
from inspector.http_load import HttpLoadRunner
from inspector.load import LengthDist, LoadSpec


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=1024,
                                 max_num_seqs=8)) as lp:
        yield lp


@pytest.fixture(scope="module")
def srv(loop):
    with ServerThread(build_app(loop)) as s:
        yield s


def _spec(**kw) -> LoadSpec:
    return LoadSpec(name="oai", num_requests=4, rate=50.0, num_turns=2, prompt_len=LengthDist("fixed", 24, 24),
                    output_len=LengthDist("fixed", 5, 5), seed=4, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("prompts", ["random ids", "text"])
def test_openai_client_runner_sends_the_aiohttp_runners_workload(srv, loop, prompts):
    tok = loop.engine.tokenizer if prompts == "text" else None
    recs = {}
    for cls in (HttpLoadRunner, OpenAIClientRunner):
        r = cls(srv.url, _spec(prompt_source=prompts), tokenizer=tok).start()
        assert r.wait(120) and not r.errors, r.errors
        recs[cls] = sorted(((x.request_id.split("-", 1)[1], x.prompt_len, x.output_len) for x in r.records))
    assert recs[HttpLoadRunner] == recs[OpenAIClientRunner]
    by_id = {rid: p for rid, p, _ in recs[OpenAIClientRunner]}
    assert all(o == 5 for _, _, o in recs[OpenAIClientRunner])
    # the second turn resends the first turn and its reply
    assert all(by_id[f"u{u}t1"] > by_id[f"u{u}t0"] + 5 for u in range(2))


def test_text_prompts_need_the_tokenizer(srv):
    with pytest.raises(ValueError, match="tokenizer"):
        OpenAIClientRunner(srv.url, _spec(prompt_source="text"))


def test_trivial_server_streams_every_chunk_at_once():
    sent = []

    async def run():
        app = trivial_app(chunks=20, tokens_per_chunk=3)
        msgs = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

        async def receive():
            return next(msgs)

        async def send(m):
            sent.append(m)
        await app({"type": "http"}, receive, send)
    asyncio.run(run())
    body = b"".join(m.get("body", b"") for m in sent).decode()
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert ids == list(range(60)) and chunks[-1]["usage"]["completion_tokens"] == 60


def test_a_null_target_measures_the_clients_own_ttft(srv, tmp_path, monkeypatch):
    # the null server (two processes here) streams each request's max_tokens ids at the cadence and in the chunks
    # the client read from the target before it and stamps its own TTFT (summed over its processes); its client - server gap is the client's own cost, set against the engine server's
    # /metrics on the same workload
    import benchmarks.common
    from benchmarks.bench_serve import main
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    results = main(["--target", f"kvscope={srv.url}", "--target", "null=null", "--num-prompts", "6",
                    "--request-rate", "inf", "--input-len", "16", "--output-len", "5", "--range-ratio", "0",
                    "--client", "aiohttp,openai", "--name", "nulltest", "--null-workers", "2"])
    null = [r for r in results if r.get("null")]
    assert [r["workload"] for r in null] == ["nulltest", "nulltest-oai"]
    for r in null:
        kv = next(x for x in results if x["name"] == "kvscope" and x["workload"] == r["workload"])
        itl = (kv["summary"].get("ITL") or {}).get("mean")                 # the target's chunk gap
        if itl is None:                                                     # every output came in one chunk
            assert r["null_itl_ms"] == 0
        else:
            assert r["null_itl_ms"] == itl > 0
        assert r["null_tokens_per_chunk"] == max(1, round(kv["chunks"]["tokens_per_chunk"]))
        assert r["completed"] == 6 and r["summary"]["output_tokens"] == 30
        assert r["server_side"]["ttft_ms"] > 0                  # the null server's own stamps, from its /metrics
    rows = {row["metric"]: row for row in json.loads((tmp_path / "serve_nulltest.json").read_text())["side_by_side"]}
    own, rel = rows["client's own TTFT (null server, ms)"], rows["/metrics TTFT vs client's less its own (%)"]
    for wl in ("nulltest", "nulltest-oai"):
        r = next(x for x in results if x["name"] == "kvscope" and x["workload"] == wl)
        seen = r["summary"]["TTFT"]["mean"] - own[f"kvscope/{wl}"]
        assert own[f"kvscope/{wl}"] == own[f"null/{wl}"] > 0
        expected = pytest.approx(100 * (r["server_side"]["ttft_ms"] - seen) / seen) if seen > 0 else None
        assert rel[f"kvscope/{wl}"] == expected
        assert rel[f"null/{wl}"] is None


def test_a_null_target_streams_at_the_pace_it_is_given(tmp_path, monkeypatch):
    # null:ITL_MS[xTOKENS]: a chunk of TOKENS ids every ITL_MS after the first, whatever ran before; the client's
    # streams carry those chunks
    import benchmarks.common
    from benchmarks.bench_serve import main
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    results = main(["--target", "paced=null:4x3", "--num-prompts", "4", "--request-rate", "inf", "--input-len", "8",
                    "--output-len", "7", "--range-ratio", "0", "--client", "aiohttp,openai", "--name", "pacetest",
                    "--null-workers", "1"])
    assert len(results) == 2
    for r in results:
        assert (r["null_itl_ms"], r["null_tokens_per_chunk"]) == (4, 3)
        assert r["completed"] == 4 and r["summary"]["output_tokens"] == 28
        assert r["chunks"]["tokens_per_chunk"] == pytest.approx(7 / 3)       # chunks of 3, 3 and 1 ids


@pytest.mark.parametrize("pace", ["4x0", "4x", "-1", "4x1.5", "fast"])
def test_a_bad_null_pace_is_a_one_line_error_naming_the_target(pace, tmp_path, monkeypatch):
    import benchmarks.common
    from benchmarks.bench_serve import main
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--target", f"paced=null:{pace}", "--num-prompts", "1"])
    assert "--target paced: null:ITL_MS[xTOKENS]" in str(e.value) and repr(pace) in str(e.value)


def test_each_request_carries_the_servers_arrival_stamp(srv, tmp_path, monkeypatch):
    # both clients read the server's arrival stamp (x-kvscope-arrival-time, one perf_counter clock on this machine)
    # of every request: after the client's send stamp and before its first chunk; the side-by-side table sets
    # /metrics' mean TTFT against the client's less the mean send -> arrival
    import benchmarks.common
    from benchmarks.bench_serve import main
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    results = main(["--target", f"kvscope={srv.url}", "--num-prompts", "6", "--request-rate", "inf",
                    "--input-len", "16", "--output-len", "5", "--range-ratio", "0", "--client", "aiohttp,openai",
                    "--name", "arrivaltest"])
    rows = {row["metric"]: row for row in json.loads((tmp_path / "serve_arrivaltest.json").read_text())["side_by_side"]}
    for r in results:
        sends = [x["send_to_arrival_ms"] for x in r["requests"]]
        assert len(sends) == 6 and all(0 < s < x["ttft_ms"] for s, x in zip(sends, r["requests"]))
        assert r["send_to_arrival"]["mean_ms"] == pytest.approx(sum(sends) / 6)
        assert r["send_to_arrival"]["p99_ms"] == max(sends)
        seen = r["summary"]["TTFT"]["mean"] - r["send_to_arrival"]["mean_ms"]
        assert rows["/metrics TTFT vs client's from arrival (%)"][f"kvscope/{r['workload']}"] == \
            pytest.approx(100 * (r["server_side"]["ttft_ms"] - seen) / seen)
