"""Hostile clients against a real uvicorn server (in-process thread): malformed HTTP, stalled connections,
abandoned uploads, half-closes, deep JSON, prompts that cannot fit, a full connection table, one API key for
every path. Each case checks the status and the error body, that good requests sent meanwhile finish untouched,
and that KV blocks and running/waiting are back at baseline afterwards."""
import concurrent.futures as cf
import json
import logging
import socket
import time

import httpx
import pytest

from engine import EngineConfig
from engine.entrypoints.openai.api_server import ServerThread, build_app
from engine.entrypoints.openai.connection import HttpLimits
from engine.runtime.async_engine import EngineLoop
from helpers import metric_sum, scrape_metrics, wait_idle

MODEL = "dummy:tiny"
# short read timeouts so stalled sockets are closed within the tests' (generous) waits; a small connection cap
LIMITS = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5, max_connections=12,
                    max_header_bytes=4096)
WAIT = 30.0                 # a hang bound, never an outcome


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=128, block_size=16, max_model_len=256,
                                 max_num_seqs=4)) as lp:
        yield lp


@pytest.fixture(scope="module")
def srv(loop):
    with ServerThread(build_app(loop, max_body_bytes=8 << 20), limits=LIMITS) as s:
        yield s


def raw(srv, data: bytes, half_close: bool = False, keep: bool = False):
    """Send `data` on a fresh connection; read until the server closes it (or `WAIT`). Returns the bytes read."""
    s = socket.create_connection((srv.host, srv.port), timeout=WAIT)
    try:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    finally:
        s.close()


def parse(resp: bytes) -> tuple[int, dict | None]:
    """The final response's status and JSON body (interim 1xx responses skipped, as clients do)."""
    while resp.startswith(b"HTTP/1.1 1"):
        resp = resp.partition(b"\r\n\r\n")[2]
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, (json.loads(body) if body.strip().startswith(b"{") else None)


def good(srv, n_tokens: int = 4) -> dict:
    r = httpx.post(srv.url + "/v1/completions", timeout=WAIT,
                   json={"prompt": [5, 6, 7], "max_tokens": n_tokens, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n_tokens
    return r.json()


def with_good_traffic(srv, loop, hostile, n: int = 3):
    """Run `hostile()` while `n` good requests run beside it; both must come out right, the engine idle."""
    with cf.ThreadPoolExecutor(n + 1) as ex:
        goods = [ex.submit(good, srv, 6) for _ in range(n)]
        result = ex.submit(hostile).result(WAIT)
        for g in goods:
            g.result(WAIT)
    wait_idle(loop)
    return result


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), len(body), extra)) + body


# ------------------------------------------------------------------------------ malformed HTTP
@pytest.mark.parametrize("data, status, code, words", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n", 400, "invalid_http",
     "Content-Length"),
    (b"GARBAGE\r\n\r\n", 400, "invalid_http", "request line"),
    (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n", 431, "headers_too_large", "4096"),
    (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 8000, 431, "headers_too_large", "4096"),
], ids=["bad-content-length", "garbage-request-line", "headers-too-large", "incomplete-headers-too-large"])
def test_malformed_http_gets_json_error(srv, loop, data, status, code, words):
    st, body = parse(with_good_traffic(srv, loop, lambda: raw(srv, data)))
    assert st == status and body["error"]["code"] == code and words in body["error"]["message"]


def test_deep_json_says_nesting_and_limit(srv, loop):
    body = b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}"
    st, err = parse(with_good_traffic(srv, loop, lambda: raw(srv, post("/v1/completions", body))))
    assert st == 400 and err["error"]["code"] == "json_too_deep"
    assert "nested too deep" in err["error"]["message"] and "200" in err["error"]["message"]


# ------------------------------------------------------------------------------ stalled connections
def test_silent_connection_is_closed(srv, loop):
    assert with_good_traffic(srv, loop, lambda: raw(srv, b"")) == b""


def test_half_request_line_gets_408(srv, loop):
    st, err = parse(with_good_traffic(srv, loop, lambda: raw(srv, b"GET /heal")))
    assert st == 408 and err["error"]["code"] == "header_timeout"


def test_partial_body_gets_408_counted_as_408(srv, loop):
    before = scrape_metrics(srv.url)
    data = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"prompt\": "
    st, err = parse(with_good_traffic(srv, loop, lambda: raw(srv, data)))
    assert st == 408 and err["error"]["code"] == "body_timeout"
    after = scrape_metrics(srv.url)
    delta = {s: metric_sum(after, "kvscope:api_requests_total", endpoint="/v1/completions", status=s)
             - metric_sum(before, "kvscope:api_requests_total", endpoint="/v1/completions", status=s)
             for s in ("408", "500")}
    assert delta == {"408": 1, "500": 0}


def test_held_body_reaches_the_app_only_when_complete():
    """Request buffering: a request whose body is still coming is not in the app (a flood of partial bodies costs
    buffers, not handlers); completed, it is served as usual, and its Content-Length's absence or chunking, or
    Expect: 100-continue, hand it on at once."""
    calls = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        calls.append(scope["path"])
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    with ServerThread(app, limits=HttpLimits(header_timeout_s=WAIT, body_timeout_s=WAIT)) as s:
        held = socket.create_connection((s.host, s.port), timeout=WAIT)
        body = b'{"prompt": "hello", "max_tokens": 2}'
        held.sendall(post("/held", body)[:-10])
        for _ in range(2):                       # round trips on other connections: the held bytes were read by now
            assert httpx.post(s.url + "/other", content=b"x", timeout=WAIT).text == "x"
        assert calls == ["/other", "/other"]
        held.sendall(body[-10:])
        out = b""
        while not out.endswith(body):
            out += held.recv(65536)
        assert out.startswith(b"HTTP/1.1 200") and calls[-1] == "/held"
        held.close()
        # not held: a body announced with Expect: 100-continue (the client waits to be told to send it)
        expect = socket.create_connection((s.host, s.port), timeout=WAIT)
        expect.sendall(post("/expect", body, b"Expect: 100-continue\r\n")[:-len(body)])
        assert expect.recv(65536).startswith(b"HTTP/1.1 100") and calls[-1] == "/expect"
        expect.close()


def test_abandoned_upload_is_499_not_500(srv, loop):
    before = scrape_metrics(srv.url)

    def count(samples, status):
        return metric_sum(samples, "kvscope:api_requests_total", endpoint="/v1/completions", status=status)

    def abandon():
        s = socket.create_connection((srv.host, srv.port), timeout=WAIT)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"ab")
        s.close()
    with_good_traffic(srv, loop, abandon)
    deadline = time.monotonic() + WAIT          # the server counts it when it notices the close: poll, bounded
    while True:
        after = scrape_metrics(srv.url)
        if count(after, "499") > count(before, "499") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert count(after, "499") - count(before, "499") == 1
    assert count(after, "500") == count(before, "500")


def test_half_close_after_full_request_gets_response(srv, loop):
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}).encode()
    st, out = parse(with_good_traffic(srv, loop, lambda: raw(srv, post("/v1/completions", body), half_close=True)))
    assert st == 200 and out["usage"]["completion_tokens"] == 3


def test_full_close_while_waiting_aborts(srv, loop):
    """A client that closes fully while its non-streamed request runs: aborted (not run to its end), 499."""
    before = scrape_metrics(srv.url)

    def aborts(samples):
        return metric_sum(samples, "kvscope:request_success_total", finished_reason="abort")

    def leave():
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}).encode()
        s = socket.create_connection((srv.host, srv.port), timeout=WAIT)
        s.sendall(post("/v1/completions", body))
        s.close()
    with_good_traffic(srv, loop, leave)
    after = scrape_metrics(srv.url)
    assert aborts(after) - aborts(before) == 1
    assert (metric_sum(after, "kvscope:api_requests_total", endpoint="/v1/completions", status="499")
            - metric_sum(before, "kvscope:api_requests_total", endpoint="/v1/completions", status="499")) == 1


def test_full_connection_table_still_serves(loop, caplog):
    """Three times max_connections idle sockets: the oldest idle ones are closed to make room (the header
    timeout is a minute, so only the cap can close them), good requests are served meanwhile, and the log
    gets one warning, not a line per socket."""
    caplog.set_level(logging.WARNING, logger="engine.entrypoints.openai.connection")
    limits = HttpLimits(header_timeout_s=60, max_connections=8)
    with ServerThread(build_app(loop), limits=limits) as s:
        idle = [socket.create_connection((s.host, s.port), timeout=WAIT) for _ in range(3 * limits.max_connections)]
        try:
            with cf.ThreadPoolExecutor(3) as ex:
                for f in [ex.submit(good, s) for _ in range(3)]:
                    f.result(WAIT)
            for sock in idle[:limits.max_connections]:
                assert sock.recv(1) == b""          # closed by the server
        finally:
            for sock in idle:
                sock.close()
    wait_idle(loop)
    warnings = [r for r in caplog.records if "connection limit reached" in r.getMessage()]
    assert len(warnings) == 1 and "max_connections=8" in warnings[0].getMessage()


# ------------------------------------------------------------------------------ prompts that cannot fit
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hello world " * (1 << 15), "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "x" * (1 << 20)], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "s" * (1 << 19)},
                                           {"role": "user", "content": "hi"}], "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * (1 << 19)}]}],
                              "max_tokens": 2}, "messages"),
], ids=["completion", "completion-batch", "chat-system", "chat-parts"])
def test_prompt_that_cannot_fit_is_refused_untokenized(srv, loop, path, body, param):
    def send():
        return httpx.post(srv.url + path, json=body, timeout=WAIT)
    r = with_good_traffic(srv, loop, send)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param
    assert "max_model_len 256" in err["message"] and "cannot fit" in err["message"]


def test_byte_bound_never_refuses_what_fits(loop):
    """The bound is sound: text at the bound of a tokenizer's longest token still counts as fitting, and text
    just under max_model_len tokens passes it."""
    ip = loop.engine.input_processor
    tok = loop.engine.tokenizer
    text = "The quick brown fox. " * 30
    n = len(tok.encode(text, add_special_tokens=False))
    assert n < ip.max_model_len
    ip.check_text_size("prompt", len(text), text)                 # fits: no error
    with pytest.raises(ValueError, match=r"prompt: .* cannot fit in max_model_len 256"):
        big = "é" * (ip.max_text_bytes // 2 + 1)                 # few characters, too many bytes
        ip.check_text_size("prompt", len(big), big)


def test_preprocessing_runs_at_most_its_concurrency_at_once():
    import asyncio
    import threading
    from engine.entrypoints.openai.serving_engine import OpenAIServing
    serving = OpenAIServing(lambda: None, None, None, None, 1 << 20, 1, None)
    serving.preprocess_concurrency = 2
    lock, now, peak = threading.Lock(), [0], [0]

    def work(i):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        threading.Event().wait(0.02)            # hold the slot a moment so calls overlap
        with lock:
            now[0] -= 1
        return i

    async def main():
        return await asyncio.gather(*(serving.preprocess(work, i) for i in range(8)))
    assert asyncio.run(main()) == list(range(8))
    assert 1 <= peak[0] <= 2
