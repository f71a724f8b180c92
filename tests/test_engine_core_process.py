"""The engine in its own process behind the OpenAI server: same tokens as in-process, metrics, and a killed
engine process fails its clients at once and is restarted."""
import asyncio
import os
import signal
import time

import httpx
import pytest

from engine import EngineConfig, SamplingParams
from engine.runtime.async_engine import EngineLoop
from engine.runtime.core_client import EngineCoreClient, EngineDied
from engine.entrypoints.openai.api_server import ServerThread, build_app

pytestmark = pytest.mark.slow

CFG = EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=256, block_size=16, max_model_len=512,
                   max_waiting_requests=64)
PROMPTS = [[3, 17, 29, 4, 8], [100, 101, 102], [7] * 40]


@pytest.fixture(scope="module")
def core():
    c = EngineCoreClient(CFG)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def srv(core):
    with ServerThread(build_app(core)) as s:
        yield s


def test_same_tokens_as_in_process(core):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 20)]
    with EngineLoop(CFG) as loop:
        ref = [loop.submit(p, sp).result(60) for p, sp in zip(PROMPTS, params)]
    streams = core.submit_many([(p, sp, None) for p, sp in zip(PROMPTS, params)])
    outs = [s.result(60) for s in streams]
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.queued_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) >= 1
    # streamed chunks add up to the final output
    chunks = list(core.submit(PROMPTS[0], params[0]))
    assert sum((c.delta_token_ids for c in chunks), []) == ref[0].token_ids
    assert chunks[-1].finished and chunks[-1].token_ids == ref[0].token_ids


def test_logprobs_through_the_engine_process(core):
    """The engine process sends each step's tokens and logprobs alone and the prompt logprobs once, with the first
    output: what the client rebuilds is what the engine in-process gives."""
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with EngineLoop(CFG) as loop:
        ref = loop.submit(PROMPTS[2], sp).result(60)
    chunks = list(core.submit(PROMPTS[2], sp))
    final = chunks[-1]
    assert len(chunks) > 1 and final.token_ids == ref.token_ids

    def flat(entries):
        return [None if e is None else [(x.token_id, round(x.logprob, 4)) for x in e] for e in entries]
    assert flat(final.logprobs) == flat(ref.logprobs)
    assert flat(final.prompt_logprobs) == flat(ref.prompt_logprobs) and len(ref.prompt_logprobs) == len(PROMPTS[2])


def test_text_decoded_in_the_server_process_is_the_engines(core):
    """Without stop strings the text is decoded in this (the API server's) process from the token ids, the engine
    process sent detokenize=False; with a stop string the engine decodes it, to stop there. Either way the text,
    whole and streamed, is what the engine in-process gives."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with EngineLoop(CFG) as loop:
        ref = [loop.submit(p, plain).result(60) for p in PROMPTS]
        stop = ref[1].text.split()[-1]                                  # a word the greedy output repeats
        stopping = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        ref_stop = loop.submit(PROMPTS[1], stopping).result(60)
    # (the first prompt's output is special tokens: no text)
    assert ref[1].text and ref[2].text and ref_stop.finish_reason == "stop" and len(ref_stop.text) < len(ref[1].text)
    sent_text = []                                  # the text the engine process sent with its token ids
    deliver = core._deliver
    core._deliver = lambda encoded: sent_text.extend(e[1] for e in encoded) or deliver(encoded)
    try:
        for p, r in zip(PROMPTS, ref):
            chunks = list(core.submit(p, plain))
            assert "".join(c.delta_text for c in chunks) == chunks[-1].text == r.text
        assert sent_text and not any(sent_text)
        assert core.submit(PROMPTS[1], stopping).result(60).text == ref_stop.text
        assert any(sent_text)
    finally:
        core._deliver = deliver


def test_http_stream_and_metrics(srv, core):
    with httpx.Client(timeout=60) as c:
        r = c.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True,
                                                      "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        with c.stream("POST", srv.url + "/v1/completions",
                      json={"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                            "stream": True, "return_token_ids": True}) as s:
            ids = []
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    ids += __import__("json").loads(line[6:])["choices"][0].get("token_ids") or []
        assert len(ids) == 8
        text = c.get(srv.url + "/metrics").text
        assert "kvscope:time_to_first_token_seconds_count" in text and "kvscope:num_requests_running" in text
        assert c.get(srv.url + "/health").status_code == 200


def test_half_cancelled_streams_below_the_limit_never_get_503(srv, core):
    """As in tests/test_serving_admission.py, with the engine's counts coming over the pipe."""
    from helpers import check_half_cancelled_storm
    check_half_cancelled_storm(srv.url, core, CFG.scheduler_config.max_waiting_requests)


def test_bad_request_is_refused_in_the_server_process(core):
    with pytest.raises(ValueError, match="prompt"):
        core.submit([], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        core.submit([1] * 600, SamplingParams(max_tokens=2))


def test_killed_engine_process_fails_clients_at_once_and_restarts(srv, core):
    async def stream_until_error(url: str) -> tuple[float, str]:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"prompt": [9, 10, 11], "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                got = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' not in line:
                        got += 1
                        if got == 2:
                            t_kill = time.perf_counter()
                            os.kill(core.pid, signal.SIGKILL)
                    elif '"error"' in line:
                        return time.perf_counter() - t_kill, line
                return time.perf_counter() - t_kill, "stream ended without an error"

    old_pid = core.pid
    waited, line = asyncio.run(stream_until_error(srv.url))
    assert waited < 20.0, waited        # the death is noticed, not the client's 60 s timeout (a hang bound)
    assert "engine" in line and ("exited" in line or "restart" in line), line
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end and not core.healthy():
        time.sleep(0.1)
    assert core.healthy() and core.pid != old_pid and core.restarts == 1
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert isinstance(core.error, EngineDied)


def test_engine_pipe_sends_without_nagle(core):
    """The serving side of the engine's TCP connection has Nagle off (set_nodelay; tests/test_ipc.py)."""
    import socket
    s = socket.socket(fileno=core._conn.fileno())
    try:
        assert s.family == socket.AF_INET and s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        s.detach()
