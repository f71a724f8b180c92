"""End to end: `python app.py` on a free port (random-weight tiny model, CPU), driven with gradio_client:
stream a prompt, run a short seeded load, check its metrics and that the block map and the timeline
reflect it; bad inputs get clear messages; settings restart the engine; compare and export work."""
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.common import free_port
from benchmarks.serve_procs import wait_ready

pytestmark = pytest.mark.slow

gradio_client = pytest.importorskip("gradio_client")
ROOT = Path(__file__).resolve().parents[1]
N_LOAD, OUT_LEN = 10, 24


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", GRADIO_ANALYTICS_ENABLED="False")
    log = open(ROOT / "assets" / "_tmp_app_e2e.log", "w") if (ROOT / "assets").is_dir() else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--model", "dummy:tiny", "--device", "cpu",
                             "--port", str(port), "--set", "num_kv_blocks=96", "--set", "max_num_seqs=16"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    if not wait_ready(proc, lambda: httpx.get(url + "healthz", timeout=1).json()["state"] == "ready", 120, 0.3):
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited with {proc.returncode}")
        proc.kill()
        raise RuntimeError("app.py did not come up")
    yield url
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
    if log is not subprocess.DEVNULL:
        log.close()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def client(server):
    return gradio_client.Client(server, verbose=False)


def load_args(n=N_LOAD, rate=20.0, all_at_once=False, seed=7, o_len=OUT_LEN, p_min=16, p_max=48, **kw):
    a = dict(name="Steady Poisson", n=n, rate=rate, all_at_once=all_at_once, burstiness=1.0, conc=0, p_kind="uniform",
             p_min=p_min, p_max=p_max, o_kind="fixed", o_min=o_len, o_max=o_len, shared=0, turns=1, think=0.0,
             seed=seed, temp=0.0, ieos=True, slo_ttft=10_000, slo_tpot=None, slo_e2el=None, fresh=True,
             target="in-process engine", url="", model="", key="")
    a.update(kw)
    return list(a.values())


def test_binds_localhost_and_has_no_share_link(server):
    assert server.startswith("http://127.0.0.1:")
    assert httpx.get(server + "healthz").json()["state"] == "ready"
    assert "gradio" in httpx.get(server).text.lower()          # the UI at /


def test_serving_api_lives_beside_the_ui(server):
    """One port serves the Gradio UI at / and the OpenAI-compatible API, /health and /metrics beside it."""
    r = httpx.post(server + "v1/completions", json={"model": "dummy:tiny", "prompt": "hi", "max_tokens": 3,
                                                    "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(server + "health").json()["status"] == "ok"
    assert "kvscope:num_requests_running" in httpx.get(server + "metrics").text
    assert "gradio" in httpx.get(server).text.lower()


def test_stream_a_prompt(client):
    job = client.submit(prompt="The quick brown fox", max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2,
                        api_name="/complete")
    chunks = list(job)
    final = job.result()
    assert len(chunks) >= 3                               # streamed, not one blob
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert "| length |" in final["stats"] and "TTFT" in final["stats"]
    assert len(final["logprobs"]) == 16 and len(final["logprobs"][0]) == 5


def test_chat_uses_the_chat_template(client):
    out = client.predict(message="What is the capital of France?", max_tokens=8, seed=1, api_name="/chat")
    assert "`chat-" in out["stats"]
    ins = client.predict("", "time", api_name="/inspector")
    chat = [r for r in ins["requests"] if r["request_id"].startswith("chat-")][-1]
    assert chat["prompt_len"] > 10                          # template tokens around the message
    assert chat["priority"] == -1                           # the app schedules by priority: a person's turn first
    assert chat["engine_index"] == 0                        # one engine: replica 0


WEATHER = {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "required": ["unit", "days"],      # bounded values: the random-weight model ends them
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}


def test_chat_calls_a_tool_that_a_grammar_enforces(client):
    for choice in ("get_weather", "required"):
        out = client.predict(message="Weather in Paris?", temperature=1.0, max_tokens=60, seed=3,
                             tools=json.dumps(WEATHER), tool_choice=choice, api_name="/chat")
        assert out["tool_calls"], out
        for call in out["tool_calls"]:
            args = json.loads(call["arguments"])
            assert call["name"] == "get_weather" and set(args) == {"unit", "days"}, call
            assert args["unit"] in ("c", "f") and 1 <= args["days"] <= 7
        assert "grammar that enforced the call" in out["text"] and '"days"' in out["text"]   # the schema, shown
    ins = client.predict("", "time", api_name="/inspector")
    assert [r for r in ins["requests"] if r["request_id"].startswith("chat-")][-1]["structured"] == "json"
    for kw, word in ((dict(tool_choice="get_time"), "not among the tools"), (dict(tools="{"), "not valid JSON"),
                     (dict(tools="", tool_choice="required"), "needs functions")):
        with pytest.raises(Exception, match=word):
            client.predict(message="hi", **{"tools": json.dumps(WEATHER), **kw}, api_name="/chat")


def test_bad_inputs_get_clear_messages(client):
    for kw, word in ((dict(prompt=""), "enter a prompt"), (dict(prompt="hi", max_tokens=10**8), "max tokens"),
                     (dict(prompt="hi", top_p=0.0), "top-p"), (dict(prompt="hi", temperature=-1.0), "temperature")):
        with pytest.raises(Exception, match=word):
            client.predict(api_name="/complete", **kw)
    for kw, word in ((dict(rate=0), "rate"), (dict(n=100000), "too many"), (dict(p_min=-5), "prompt min"),
                     (dict(o_len=10**6), "max_model_len")):
        msg = client.predict(*load_args(**kw), api_name="/start_load")[0]
        assert "⚠️" in msg and word in msg, msg


def test_seeded_load_metrics_block_map_and_timeline(client):
    # arrivals over ~2 s, each request alive for 160 decode steps: the inspector (refreshed every second)
    # cannot miss a load request holding blocks, however fast the machine
    out_len = 160
    msg = client.predict(*load_args(rate=5.0, o_len=out_len), api_name="/start_load")[0]
    assert msg.startswith("Started"), msg
    owned = None
    slowest = 0.0
    deadline = time.time() + 120
    while time.time() < deadline:
        t0 = time.perf_counter()                       # the UI stays responsive while the engine is loaded
        assert httpx.get(client.src.rstrip("/") + "/healthz", timeout=10).json()["state"] == "ready"
        slowest = max(slowest, time.perf_counter() - t0)
        rep = client.predict(api_name="/load_report")
        if owned is None:
            ins = client.predict("", "time", api_name="/inspector")
            tables = ins["kv"]["block_tables"]
            if any(k.startswith("L") for k in tables):
                owned = ins
        if rep["progress"]["done"]:
            break
        time.sleep(0.1)
    p, s = rep["progress"], rep["summary"]
    assert slowest < 3.0, f"the app took {slowest:.2f} s to answer while load ran"
    assert p["finished"] == N_LOAD and p["failed"] == 0
    assert s["completed"] == N_LOAD and s["output_tokens"] == N_LOAD * out_len
    for m in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert s[m]["n"] > 0 and 0 < s[m]["p50"] <= s[m]["p99"]
    assert s["TPOT"]["n"] == N_LOAD and s["ITL"]["n"] == N_LOAD * (out_len - 1)
    assert s["goodput"] is not None and s["output_throughput"] > 0
    # the block map showed load requests owning blocks while it ran
    assert owned is not None, "never saw a load request holding KV blocks"
    rid = next(k for k in owned["kv"]["block_tables"] if k.startswith("L"))
    bm = json.loads(owned["plots"]["block_map"])
    hover = " ".join(sum(bm["data"][0]["text"], []))
    assert rid in hover
    # the timeline has every load request with prefill and decode spans
    ins = client.predict(rid, "time", api_name="/inspector")
    tl = json.loads(ins["plots"]["timeline"])
    decode = next(t for t in tl["data"] if t.get("name") == "decode")
    load_ids = {r["request_id"] for r in ins["requests"] if r["request_id"].startswith("L")}
    assert len(load_ids) == N_LOAD and load_ids <= set(decode["y"])
    assert all({"prefill", "decode"} <= set(r["phases"]) for r in ins["requests"] if r["request_id"] in load_ids)
    assert ins["totals"]["finished"] >= N_LOAD
    lat = json.loads(ins["plots"]["latency"])
    assert sum(next(t for t in lat["data"] if t["name"] == "TTFT")["y"]) == N_LOAD


def test_load_is_seeded(client):
    """Same seed -> same prompts: identical prompt lengths request by request."""
    lens = []
    for _ in range(2):
        assert client.predict(*load_args(n=4, all_at_once=True, o_len=2), api_name="/start_load")[0].startswith("Started")
        while not client.predict(api_name="/load_report")["progress"]["done"]:
            time.sleep(0.1)
        ins = client.predict("", "time", api_name="/inspector")
        lens.append([r["prompt_len"] for r in ins["requests"] if r["request_id"].startswith("L")])
    assert lens[0] == lens[1] and len(lens[0]) == 4


def test_export_csv_and_trace(client):
    files = client.predict(api_name="/export_csv")
    with open(files[0]) as f:
        rows = list(csv.DictReader(f))
    assert rows and {"ttft_ms", "tpot_ms", "e2el_ms"} <= set(rows[0])
    files = client.predict(api_name="/export_trace")
    tr = json.loads(Path(files[0]).read_text())
    assert any(e.get("cat") == "decode" for e in tr["traceEvents"])


def test_compare_two_configs(client):
    msg = client.predict(True, True, True, "continuous", 2048, 16, 96, 16, "auto", True, True, "off", 3, "none",
                         False, False, True, "continuous", 2048, 16, 96, 16, "auto", True, False, "off", 3, "int8",
                         "One burst", 6, 0, 8, api_name="/compare")
    assert msg.startswith("Running"), msg
    deadline = time.time() + 120
    while time.time() < deadline:
        rep = client.predict(api_name="/compare_report")
        if rep.get("done"):
            break
        time.sleep(0.3)
    assert rep["status"] == "done", rep
    a, b = rep["results"]["A"], rep["results"]["B"]
    assert a["completed"] == b["completed"] == 6
    assert a["prompt_tokens"] == b["prompt_tokens"]         # the same seeded workload
    assert {"A", "B", "B / A"} <= set(rep["table"][0])


def test_lesson_runs_from_its_button(client):
    md, chart = client.predict("dummy:tiny (fast)", "small", api_name="/lesson_batch_sweep")
    assert md.startswith("**Batch-size sweep**") and "tok_s_ratio" in md, md
    assert "decode tok/s" in json.dumps(chart)


def test_settings_validate_and_restart(client):
    from engine.config import EngineConfig
    vals = dict(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_num_seqs=16).to_dict())
    vals["speculative_method"] = "off"
    vals["quantization"] = "none"
    vals["draft_model"] = ""
    bad = dict(vals, block_size=3)
    msg = client.predict(*bad.values(), api_name="/apply_settings")
    assert "⚠️" in msg and "block_size" in msg
    msg = client.predict(*vals.values(), api_name="/apply_settings")
    assert msg.startswith("✅") and "64 KV blocks" in msg, msg
    out = client.predict(prompt="after restart", max_tokens=4, api_name="/complete")
    assert "| length |" in out["stats"]


def test_stop_cancels_the_request_and_frees_its_blocks(client):
    job = client.submit(prompt="a long story", max_tokens=1000, ignore_eos=True, api_name="/complete")
    deadline = time.time() + 30
    while time.time() < deadline and len(job.outputs()) < 3:
        time.sleep(0.05)
    client.predict(api_name="/stop")
    final = job.result(timeout=30)
    assert "| abort |" in final["stats"]
    n_out = int(final["stats"].split("\n")[2].split("|")[7])
    assert n_out < 1000
    ins = client.predict("", "time", api_name="/inspector")
    assert not [k for k in ins["kv"]["block_tables"] if k.startswith("completion-")]
    req = [r for r in ins["requests"] if r["request_id"].startswith("completion-")][-1]
    assert req["status"] == "aborted"


def test_load_over_http_to_this_server(client, server):
    """Target HTTP, URL empty: the same seeded workload goes over the wire to this app's own /v1 API; the
    summary is measured client-side, and the engine (block map / timeline / /metrics) served it."""
    before = httpx.get(server + "metrics").text
    gen0 = sum(float(x.split()[-1]) for x in before.splitlines() if x.startswith("kvscope:generation_tokens_total"))
    msg = client.predict(*load_args(n=6, o_len=8, target="HTTP (OpenAI-compatible)"), api_name="/start_load")[0]
    assert msg.startswith("Started") and "/v1" in msg, msg
    deadline = time.time() + 120
    while time.time() < deadline:
        rep = client.predict(api_name="/load_report")
        if rep["progress"]["done"]:
            break
        time.sleep(0.2)
    s = rep["summary"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["output_tokens"] == 6 * 8, s
    assert s["http_status"] == {"200": 6} and s["target"] == server + "v1"
    # one gap per chunk after the first; a chunk carries every token a stream got in one engine step, so a
    # request of 8 tokens has 1 to 7 gaps (as many as the engine's steps split them into)
    assert s["TTFT"]["n"] == 6 and 6 <= s["ITL"]["n"] <= 6 * 7
    after = httpx.get(server + "metrics").text
    gen1 = sum(float(x.split()[-1]) for x in after.splitlines() if x.startswith("kvscope:generation_tokens_total"))
    assert gen1 - gen0 == 6 * 8                                  # the engine generated exactly those tokens
    ins = client.predict("", "time", api_name="/inspector")
    assert sum(1 for r in ins["requests"] if r["status"] == "finished") >= 6      # the timeline saw them
    bad = client.predict(*load_args(target="HTTP (OpenAI-compatible)", url="ftp://nowhere"), api_name="/start_load")[0]
    assert "⚠️" in bad and "base URL" in bad, bad
    bad = client.predict(*load_args(target="HTTP (OpenAI-compatible)", url="http://127.0.0.1:9"),
                         api_name="/start_load")[0]
    assert "⚠️" in bad and "could not reach" in bad, bad


def test_api_only_with_api_key():
    """`python app.py --api-only --api-key K`: the API without the UI, every path but /health guarded."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", GRADIO_ANALYTICS_ENABLED="False")
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--model", "dummy:tiny", "--device", "cpu",
                             "--port", str(port), "--api-only", "--api-key", "k3y", "--set", "num_kv_blocks=32"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, f"app.py --api-only exited with {proc.returncode}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(url + "/").status_code == 401            # every path but /health needs the key
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/", headers=auth).status_code == 404            # no UI
        assert httpx.get(url + "/healthz", headers=auth).status_code == 404
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
