"""The official `openai` client as a benchmark client, and what that client itself costs per chunk.

`OpenAIClientRunner` sends the same seeded workload as `HttpLoadRunner` (arrivals, multi-turn history, token-id
prompts, sharding over processes) through `AsyncOpenAI().completions.create(stream=True)`, the client most
applications use; its per-chunk parsing (SSE decoding, pydantic models) runs on the client's event loop, so in
a burst it can be the bottleneck that a thin aiohttp client is not.

    python benchmarks/openai_client.py cost [--chunks 256] [--tokens-per-chunk 1,8] [--requests 64] [--procs 1]

starts a trivial server that answers every streamed completion at once with the given number of chunks (no
engine, no waiting) and reports the client's own cost: wall time and CPU time per chunk, and the time from
sending a request to its first chunk. Subtract it from a measured TTFT / chunk gap to see the server's part.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import free_port  # noqa: E402
from engine.outputs import RequestMetrics  # noqa: E402
from inspector.http_load import HttpLoadRunner, _arrival_stamp, _HttpError  # noqa: E402
from inspector.load import LoadItem  # noqa: E402
from inspector.recorder import RequestRecord  # noqa: E402


class OpenAIClientRunner(HttpLoadRunner):
    """HttpLoadRunner whose requests go through one `openai.AsyncOpenAI` per process (no retries; connection
    pool as large as the workload)."""

    _oai = None

    def _client(self):
        if self._oai is None:
            import httpx
            from openai import AsyncOpenAI
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self._oai = AsyncOpenAI(base_url=self.target.v1, api_key=self.target.api_key or "-", max_retries=0,
                                    timeout=self.target.timeout_s,
                                    http_client=httpx.AsyncClient(limits=limits, timeout=self.target.timeout_s))
        return self._oai

    async def _one(self, _session, it: LoadItem, prompt: list[int]) -> list[int]:
        import openai
        spec = self.spec
        rid = f"{self.run_id}-u{it.user}t{it.turn}" if spec.num_turns > 1 else f"{self.run_id}-{it.index:03d}"
        extra = {"ignore_eos": spec.ignore_eos, "return_token_ids": True} if self.target.extensions else {}
        m = RequestMetrics(arrival_time=time.perf_counter())        # the client's send stamp
        out_ids: list[int] = []
        usage, finish = None, None
        try:
            stream = await self._client().completions.create(
                model=self.model, prompt=prompt, max_tokens=it.max_tokens, temperature=spec.temperature,
                seed=spec.seed, stream=True, stream_options={"include_usage": True}, extra_body=extra)
            server_arrival = _arrival_stamp(stream.response.headers)
            async for chunk in stream:
                now = time.perf_counter()
                for ch in chunk.choices:
                    ids = getattr(ch, "token_ids", None) or []
                    if ch.text or ids:
                        if m.first_token_time is None:
                            m.first_token_time = now
                        m.token_times.append(now)
                        m.last_token_time = now
                    out_ids.extend(ids)
                    if ch.finish_reason:
                        finish = ch.finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage
        except openai.APIStatusError as e:
            raise _HttpError(e.status_code, str(e))
        m.finished_time = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None)
        m.num_cached_tokens = int(getattr(details, "cached_tokens", 0) or 0)
        out_len = usage.completion_tokens if usage is not None else (len(out_ids) or len(m.token_times))
        rec = RequestRecord(request_id=rid, prompt_len=int(usage.prompt_tokens if usage else len(prompt)),
                            output_len=int(out_len), finish_reason=finish or "stop", metrics=m,
                            server_arrival=server_arrival)
        with self._lock:
            self.records.append(rec)
            self._finished += 1
            self.status_counts[200] += 1
        return out_ids


# ------------------------------------------------------------------------------ the client's own cost
def _chunk(i: int, tokens: int) -> bytes:
    """One completion chunk shaped as kvscope and vLLM send it."""
    body = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": " tok" * tokens, "logprobs": None, "finish_reason": None,
                         "token_ids": list(range(i, i + tokens))}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def trivial_app(chunks: int | None = None, tokens_per_chunk: int = 1, itl_s: float = 0.0, ttft=None):
    """An ASGI app with no engine: /v1/completions streams its tokens at once (`chunks` chunks of
    `tokens_per_chunk` ids; chunks None: the request's max_tokens ids), then usage and [DONE]. itl_s > 0: the
    first chunk at once and one chunk every itl_s after it, a server's decode cadence. /v1/models lists model "m";
    /metrics gives its own mean TTFT (request read -> first chunk handed to the transport) under kvscope's name,
    so that a client's TTFT against it, less that, is the client's own cost. ttft: the [sum (s), count] it adds
    to (shared by the processes of serve_trivial)."""
    per_write = 16 if itl_s <= 0 else 1     # chunks per transport write, as a busy server batches them
    ttft = ttft if ttft is not None else [0.0, 0]

    def stream_bodies(n: int) -> list[bytes]:
        parts = [_chunk(i, min(tokens_per_chunk, n - i)) for i in range(0, n, tokens_per_chunk)]
        return [b"".join(parts[k:k + per_write]) for k in range(0, len(parts), per_write)]

    fixed = stream_bodies(chunks * tokens_per_chunk) if chunks is not None else None

    def tail(n: int, prompt_tokens: int) -> bytes:
        usage = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                           "total_tokens": prompt_tokens + n}}
        return b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"

    async def answer(send, status: int, body: bytes, ctype: bytes = b"application/json"):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        t0 = time.perf_counter()
        path = scope.get("path", "/v1/completions")
        if path == "/v1/models":
            return await answer(send, 200, json.dumps({"object": "list", "data": [
                {"id": "m", "object": "model", "owned_by": "kvscope"}]}).encode())
        if path == "/metrics":
            text = ("# TYPE kvscope:time_to_first_token_seconds summary\n"
                    f"kvscope:time_to_first_token_seconds_sum {ttft[0]}\n"
                    f"kvscope:time_to_first_token_seconds_count {ttft[1]}\n")
            return await answer(send, 200, text.encode(), b"text/plain; version=0.0.4")
        req = json.loads(raw or b"{}")
        prompt = req.get("prompt")
        n = chunks * tokens_per_chunk if chunks is not None else int(req.get("max_tokens") or 16)
        bodies = fixed if fixed is not None else stream_bodies(n)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-kvscope-arrival-time", b"%.6f" % t0)]})
        for i, body in enumerate(bodies):
            if i and itl_s > 0:
                await asyncio.sleep(itl_s)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            if i == 0:
                ttft[0] += time.perf_counter() - t0
                ttft[1] += 1
        await send({"type": "http.response.body", "body": tail(n, len(prompt) if isinstance(prompt, list) else 1),
                    "more_body": False})
    return app


def serve_trivial(port: int, chunks: int | None = None, tokens_per_chunk: int = 1, itl_s: float = 0.0,
                  workers: int = 1) -> None:
    """Run trivial_app on 127.0.0.1:port until killed (a process target). workers > 1: that many processes
    accept on one listening socket (as a server with several API processes spreads its streams), their TTFT
    stamps summed in shared memory."""
    import socket

    import uvicorn
    if workers <= 1:
        uvicorn.run(trivial_app(chunks, tokens_per_chunk, itl_s), host="127.0.0.1", port=port, log_level="error")
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    app = trivial_app(chunks, tokens_per_chunk, itl_s, mp.get_context("fork").Array("d", 2))   # [sum, count]

    def serve():
        server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
        asyncio.run(server.serve(sockets=[sock]))
    procs = [mp.get_context("fork").Process(target=serve, daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


async def _client_cost(url: str, requests: int) -> dict:
    from openai import AsyncOpenAI
    import httpx
    c = AsyncOpenAI(base_url=url, api_key="-", max_retries=0,
                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=None)))
    firsts, n_chunks = [], 0

    async def one():
        nonlocal n_chunks
        t = time.perf_counter()
        first = None
        async for ch in await c.completions.create(model="m", prompt=[1], max_tokens=1, stream=True):
            if ch.choices and first is None:
                first = time.perf_counter() - t
            n_chunks += bool(ch.choices)
        firsts.append(first)

    await one()                                          # connection and imports warm
    n_chunks, firsts = 0, []
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"chunks": n_chunks, "wall_s": wall, "cpu_s": cpu, "first_chunk_ms_mean": 1e3 * sum(firsts) / len(firsts)}


def _cost_proc(conn, url: str, requests: int) -> None:
    conn.send(asyncio.run(_client_cost(url, requests)))


def client_cost(chunks: int, tokens_per_chunk: int, requests: int, procs: int) -> dict:
    """The openai client's cost against the trivial server: `procs` processes, each `requests` streams at once."""
    import httpx
    ctx = mp.get_context("spawn")
    port = free_port()
    server = ctx.Process(target=serve_trivial, args=(port, chunks, tokens_per_chunk), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        pipes, ps = [], []
        for _ in range(procs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_cost_proc, args=(b, url, requests), daemon=True)
            p.start()
            pipes.append(a)
            ps.append(p)
        res = [a.recv() for a in pipes]
        for p in ps:
            p.join(10)
    finally:
        server.kill()
    n = sum(r["chunks"] for r in res)
    return {"chunks_per_request": chunks, "tokens_per_chunk": tokens_per_chunk, "requests_per_proc": requests,
            "procs": procs, "chunks": n, "us_per_chunk_cpu": 1e6 * sum(r["cpu_s"] for r in res) / n,
            "us_per_chunk_wall": 1e6 * max(r["wall_s"] for r in res) / (n / procs),
            "chunks_per_s_per_proc": (n / procs) / max(r["wall_s"] for r in res),
            "first_chunk_ms_mean": sum(r["first_chunk_ms_mean"] for r in res) / len(res)}


def main(argv=None) -> list[dict]:
    from benchmarks.common import print_table, write_json
    ap = argparse.ArgumentParser(description="the openai client's own cost per streamed chunk")
    ap.add_argument("mode", choices=["cost"])
    ap.add_argument("--chunks", type=int, default=256, help="chunks per streamed request")
    ap.add_argument("--tokens-per-chunk", default="1,8", help="comma list: token ids per chunk")
    ap.add_argument("--requests", type=int, default=64, help="streams at once per client process")
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--name", default="openai_client_cost")
    args = ap.parse_args(argv)
    rows = [client_cost(args.chunks, int(t), args.requests, args.procs) for t in args.tokens_per_chunk.split(",")]
    print_table(rows, ["tokens_per_chunk", "chunks", "us_per_chunk_cpu", "us_per_chunk_wall",
                       "chunks_per_s_per_proc", "first_chunk_ms_mean"])
    print(f"wrote {write_json(args.name, {'host_cores': os.cpu_count(), 'rows': rows})}")
    return rows


if __name__ == "__main__":
    main()
