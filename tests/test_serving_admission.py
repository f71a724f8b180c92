"""Serving under concurrent load: submission never waits for an engine step, arrival is stamped before
tokenization, the front-end wait counts in TTFT, and a storm of dropped streams leaks no KV block."""
import asyncio
import json
import threading
import time

import httpx
import pytest

from engine import EngineConfig, SamplingParams
from engine.runtime.async_engine import EngineLoop
from engine.entrypoints.openai.api_server import ServerThread, build_app
from helpers import wait_idle

MODEL = "dummy:tiny"


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=512, block_size=16, max_model_len=512,
                                 max_num_seqs=64, max_num_batched_tokens=256)) as lp:
        yield lp


def test_burst_from_50_threads_is_admitted_within_two_steps(loop):
    """200 requests from 50 threads while the engine thread is held inside a step: every submit returns
    (none waits for the step), and all reach the engine's waiting queue within two steps of submitting."""
    arrived: dict[str, int] = {}
    in_step, release, left_step = threading.Event(), threading.Event(), threading.Event()
    gate = {"armed": False}

    def listener(e):
        if getattr(e, "kind", "") == "arrived":
            arrived[e.request_id] = e.step
        elif hasattr(e, "scheduled") and gate["armed"]:
            gate["armed"] = False
            in_step.set()
            release.wait(30)          # hold the engine thread inside this step until the submits are done
            left_step.set()

    unsub = loop.engine.events.subscribe(listener)
    busy = loop.submit([5] * 8, SamplingParams(max_tokens=400, ignore_eos=True, temperature=0))
    submitted: dict[str, int] = {}
    streams = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def worker(w: int):
        start.wait()
        for k in range(4):
            rid = f"burst-{w}-{k}"
            step_before = loop.engine.step_index
            s = loop.submit([7 + w, 11 + k, 3], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0),
                            request_id=rid)
            with lock:
                submitted[rid] = step_before
                streams.append(s)

    try:
        gate["armed"] = True
        assert in_step.wait(30)
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        returned_during_step = not left_step.is_set()
        release.set()
        for s in streams:
            assert s.result(60).finish_reason == "length"
    finally:
        release.set()
        unsub()
        busy.cancel()
    assert returned_during_step
    assert len(submitted) == 200
    lags = {rid: arrived[rid] - step for rid, step in submitted.items()}
    assert max(lags.values()) <= 2, sorted(lags.values())[-10:]
    wait_idle(loop, 30)


@pytest.fixture
def tokenize_calls(loop):
    """When the engine's tokenizer was called (a spy around LLMEngine.tokenize)."""
    proc, calls = loop.engine.input_processor, []
    real = proc.tokenize

    def spy(text):
        calls.append(time.perf_counter())
        return real(text)

    proc.tokenize = spy
    yield calls
    proc.tokenize = real


def test_arrival_is_stamped_before_tokenization(loop, tokenize_calls):
    calls = tokenize_calls
    t_before = time.perf_counter()
    out = loop.submit("a prompt to tokenize", SamplingParams(max_tokens=2, ignore_eos=True)).result(30)
    m = out.metrics
    assert calls and t_before <= m.arrival_time <= calls[0]
    assert m.arrival_time <= m.queued_time <= m.first_scheduled_time <= m.first_token_time
    assert m.frontend_time == m.queued_time - m.arrival_time
    assert m.ttft == m.first_token_time - m.arrival_time


def test_explicit_arrival_time_counts_in_ttft_and_timeline(loop):
    """A caller that received the request earlier passes that stamp: TTFT and queue time count the whole
    wait, and the inspector's recorder shows it as a front-end span."""
    from inspector.recorder import Recorder
    rec = Recorder()
    rec.attach(loop.engine.events)
    try:
        t_arrival = time.perf_counter() - 0.25          # received 250 ms ago (e.g. queued in a web server)
        out = loop.submit([4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True), request_id="late-1",
                          arrival_time=t_arrival).result(30)
        snap = rec.snapshot()
    finally:
        rec.detach()
    assert out.metrics.arrival_time == t_arrival
    assert out.metrics.ttft >= 0.25 and out.metrics.queue_time >= 0.25 and out.metrics.frontend_time >= 0.25
    tr = snap.request_map["late-1"]
    assert tr.arrival == t_arrival
    fe = [sp for sp in tr.spans if sp.phase == "frontend"]
    assert len(fe) == 1 and fe[0].start == t_arrival and fe[0].end - fe[0].start >= 0.25
    assert fe[0].end <= min(sp.start for sp in tr.spans if sp.phase != "frontend")


def test_submit_many_is_all_or_nothing(loop):
    ok = [([1, 2, 3], SamplingParams(max_tokens=2), "many-ok")]
    with pytest.raises(ValueError, match="prompt"):
        loop.submit_many(ok + [([], SamplingParams(max_tokens=2), "many-bad")])
    with pytest.raises(ValueError, match="request_id"):
        loop.submit_many([([1], SamplingParams(max_tokens=2), "dup"), ([2], SamplingParams(max_tokens=2), "dup")])
    assert "many-ok" not in loop._streams and "dup" not in loop._streams
    wait_idle(loop, 30)


def test_http_arrival_stamped_by_the_server_before_tokenization(loop, tokenize_calls):
    finals = []
    unsub = loop.engine.events.subscribe(lambda e: finals.append(e) if getattr(e, "kind", "") == "arrived" else None)
    try:
        with ServerThread(build_app(loop)) as srv:
            t_sent = time.perf_counter()
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 3,
                                                              "ignore_eos": True}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        unsub()
    ev = finals[-1]
    assert t_sent <= ev.arrival_time <= tokenize_calls[-1] <= ev.time


def test_disconnect_storm_frees_every_block(loop):
    """100 streams dropped mid-flight: every request is aborted and every KV block is free again."""
    aborted = []
    unsub = loop.engine.events.subscribe(lambda e: aborted.append(e.request_id)
                                         if getattr(e, "kind", "") == "aborted" else None)
    unslow = loop.engine.events.subscribe(lambda e: time.sleep(0.002) if hasattr(e, "scheduled") else None)

    async def storm(url: str) -> int:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            async def one(i: int) -> int:
                body = {"prompt": [3 + i % 50, 9, 27], "max_tokens": 400, "stream": True, "ignore_eos": True}
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    got = 0
                    async for line in r.aiter_lines():
                        got += line.startswith("data: {")
                        if got == 2:
                            return got          # leaving the block drops the connection mid-stream
                return got
            return sum(await asyncio.gather(*(one(i) for i in range(100))))

    try:
        with ServerThread(build_app(loop)) as srv:
            assert asyncio.run(storm(srv.url)) == 200
            s = wait_idle(loop, 30)
    finally:
        unsub()
        unslow()
    assert len(aborted) == 100
    assert s["num_free_blocks"] == loop.engine.num_blocks - 1


class _Transport:
    """The least of an asyncio transport uvicorn's protocol uses (no socket: the protocol is driven directly)."""

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data):
        pass

    def is_closing(self):
        return False

    def close(self):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def set_write_buffer_limits(self, *a, **k):
        pass


def test_arrival_protocol_stamps_at_accept_then_at_first_bytes():
    """The server's HTTP protocol stamps a connection's first request when the connection was accepted (bytes
    that waited for the event loop still count), and a kept-alive connection's next request when its bytes
    were read; the ASGI app (the API middleware) then finds the stamp in scope["state"]."""
    import uvicorn
    from uvicorn.server import ServerState

    from engine.entrypoints.openai.arrival import ArrivalProtocol
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["state"].get("kvscope_arrival"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        cfg = uvicorn.Config(app, log_level="warning")
        cfg.load()
        proto = ArrivalProtocol(config=cfg, server_state=ServerState(), app_state={})
        t_a = time.perf_counter()
        proto.connection_made(_Transport())
        t_b = time.perf_counter()
        await asyncio.sleep(0.02)                      # the request's bytes are read later
        proto.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.01)
        t_c = time.perf_counter()
        proto.data_received(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        t_d = time.perf_counter()
        for _ in range(50):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.01)
        return t_a, t_b, t_c, t_d

    t_a, t_b, t_c, t_d = asyncio.run(main())
    assert len(seen) == 2
    assert t_a <= seen[0] <= t_b                       # the first request: when its connection was accepted
    assert t_c <= seen[1] <= t_d                       # the next one: when its bytes came in


@pytest.mark.slow
def test_half_cancelled_streams_below_the_limit_never_get_503():
    """64 concurrent streams under max_waiting_requests=64, every other one closed after its first chunk: none
    is refused, /metrics never shows more running + waiting requests than exist, and both return to 0 (the
    engine in its own process: tests/test_engine_core_process.py)."""
    from helpers import check_half_cancelled_storm
    with EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=256, block_size=16, max_model_len=256,
                                 max_num_seqs=16, max_waiting_requests=64)) as lp:
        with ServerThread(build_app(lp)) as srv:
            check_half_cancelled_storm(srv.url, lp, 64)


def test_step_failure_fails_one_request_and_the_others_stream_on(loop, monkeypatch):
    """A request whose rows make the sampler raise gets a 500 (its stream: an error event); streams beside it
    finish with the tokens they get alone; /metrics counts the failed step; no KV block is left in use."""
    from engine.sample.sampler import Sampler
    from helpers import metric_sum, scrape_metrics
    real = Sampler.__call__

    def call(self, seqs, mask, logits):
        if any(m and s.params.seed == 4242 and s.num_output_tokens >= 2 for s, m in zip(seqs, mask)):
            raise FloatingPointError("probability tensor contains either inf, nan or element < 0")
        return real(self, seqs, mask, logits)

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    with ServerThread(build_app(loop)) as srv:
        def body(p, **kw):
            return {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                    **kw}
        alone = [httpx.post(srv.url + "/v1/completions", json=body(p), timeout=60).json()["choices"][0]["token_ids"]
                 for p in prompts]
        m0 = scrape_metrics(srv.url)
        failures0 = metric_sum(m0, "kvscope:step_failures_total")
        fails0 = metric_sum(m0, "kvscope:request_failures_total")
        monkeypatch.setattr(Sampler, "__call__", call)

        async def mixed(url: str):
            async with httpx.AsyncClient(timeout=60) as c:
                async def stream(p):
                    ids = []
                    async with c.stream("POST", url + "/v1/completions", json=body(p, stream=True)) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                ch = json.loads(line[6:])
                                assert "error" not in ch, ch
                                ids += ch["choices"][0]["token_ids"]
                    return ids

                async def bad_stream():
                    async with c.stream("POST", url + "/v1/completions",
                                        json=body([20, 21, 22], stream=True, seed=4242)) as r:
                        return [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                                if line.startswith("data: {")]
                bad_plain = c.post(url + "/v1/completions", json=body([30, 31], seed=4242))
                return await asyncio.gather(*(stream(p) for p in prompts), bad_stream(), bad_plain)

        *good, bad_chunks, bad_plain = asyncio.run(mixed(srv.url))
        s = wait_idle(loop, 30)
        m = scrape_metrics(srv.url)
    assert good == alone
    assert "error" in bad_chunks[-1] and "FloatingPointError" in bad_chunks[-1]["error"]["message"]
    assert bad_plain.status_code == 500 and bad_plain.json()["error"]["code"] == "engine_error"
    assert "FloatingPointError" in bad_plain.json()["error"]["message"]
    assert metric_sum(m, "kvscope:step_failures_total") - failures0 >= 1      # both may fail in one step
    assert metric_sum(m, "kvscope:request_failures_total") - fails0 == 2
    assert s["num_free_blocks"] == loop.engine.num_blocks - 1
