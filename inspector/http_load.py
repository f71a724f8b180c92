"""Simulated users over HTTP: the load generator's workloads sent to any OpenAI-compatible server.

The same seeded `LoadSpec` as `inspector.load` (gamma/Poisson arrivals, length distributions, shared
prefix, multi-turn) is built into the same items (`build_workload`), then each request is sent as a
streaming `POST /v1/completions` whose prompt is the token-id list (exact lengths on any server that
accepts token-id prompts: kvscope, vLLM, SGLang, llama.cpp, OpenAI), or to `/v1/chat/completions` with
the ids decoded to text by a tokenizer you pass.

Timings are taken over the wire on this machine's `time.perf_counter()` clock (the engine's clock, so
an in-process server's records line up with the inspector's timeline): arrival = just before the
request is sent; first token = the first streamed chunk with text (or token ids); one token stamp per
such chunk (the ITL samples); finish = the end of the stream. Token counts come from the stream's final
`usage` (`stream_options.include_usage`). Results are `RequestRecord`s, the type the in-process
`LoadRunner` produces, so `inspector.metrics.summarize` reports both the same way.

`HttpLoadRunner` has LoadRunner's surface (`start`, `stop`, `wait`, `done`, `progress`, `summary`,
`records`, `errors`), so the UI can offer both targets; `run_http_load` is the one-call blocking form.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import httpx

from engine.outputs import RequestMetrics
from inspector import metrics as M
from inspector.load.runner import RunState
from inspector.load.spec import LoadSpec
from inspector.load.workload import LoadItem, build_workload
from inspector.recorder import RequestRecord

log = logging.getLogger(__name__)
_run_ids = itertools.count(1)
DEFAULT_VOCAB = 32000        # random prompt ids stay below this unless the server says more (/v1/models)


def _arrival_stamp(headers) -> float | None:
    """The server's arrival stamp of a request (kvscope's `x-kvscope-arrival-time` response header: its
    time.perf_counter(), this machine's clock when client and server share it), or None."""
    v = headers.get("x-kvscope-arrival-time")
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


@dataclass
class HttpTarget:
    """Where to send load. base_url: "http://127.0.0.1:8000" (with or without a trailing /v1)."""
    base_url: str
    model: str | None = None          # None: the first model of GET /v1/models
    api_key: str | None = None
    endpoint: str = "completions"     # "completions" (token-id prompts) | "chat" (needs `tokenizer`)
    extensions: bool = True           # send vLLM-style fields (ignore_eos, return_token_ids); off for OpenAI
    timeout_s: float = 600.0          # per request
    tokenizer: Any = None             # decodes token ids to text for endpoint="chat"
    headers: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL: must start with http:// or https:// (got {self.base_url!r})")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint: must be 'completions' or 'chat' (got {self.endpoint!r})")
        if self.endpoint == "chat" and self.tokenizer is None:
            raise ValueError("endpoint 'chat' needs a tokenizer to turn the workload's token ids into text")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout: must be > 0 s (got {self.timeout_s!r})")

    @property
    def v1(self) -> str:
        b = self.base_url.rstrip("/")
        return b if b.endswith("/v1") else b + "/v1"

    def auth_headers(self) -> dict:
        h = dict(self.headers)
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def discover(target: HttpTarget, timeout: float = 10.0) -> dict:
    """GET /v1/models: {"model", "max_model_len", "vocab_size"} (None where the server does not say)."""
    r = httpx.get(target.v1 + "/models", headers=target.auth_headers(), timeout=timeout)
    if r.status_code != 200:
        raise ValueError(f"base URL: GET {target.v1}/models answered HTTP {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"base URL: {target.v1}/models lists no models")
    card = next((m for m in data if m.get("id") == target.model), None) if target.model else data[0]
    if card is None:
        raise ValueError(f"model: {target.model!r} is not served at {target.v1} "
                         f"(it serves {[m.get('id') for m in data]})")
    return {"model": card["id"], "max_model_len": card.get("max_model_len"), "vocab_size": card.get("vocab_size")}


class _HttpError(Exception):
    def __init__(self, status: int | str, message: str):
        super().__init__(f"HTTP {status}: {message}" if isinstance(status, int) else f"{status}: {message}")
        self.status = status


class HttpLoadRunner(RunState):
    """Simulated users sending `spec` to an OpenAI-compatible server; LoadRunner's interface.

    `start()` returns at once (the requests run on an asyncio loop in a background thread);
    `progress()`/`summary()` may be polled from any thread; `stop()` cancels what is in flight by closing
    its connections (a kvscope server then aborts those requests and frees their KV blocks)."""

    def __init__(self, target: HttpTarget | str, spec: LoadSpec, slo: M.SLO | None = None,
                 vocab_size: int | None = None, special_ids=(), max_model_len: int | None = None,
                 on_record: Callable[[RequestRecord], None] | None = None, discover_server: bool = True,
                 shard: tuple[int, int] = (0, 1), warm_connections: bool = False, tokenizer: Any = None):
        self.target = HttpTarget(target) if isinstance(target, str) else target
        self.spec = spec
        self.slo = slo
        self.run_id = f"H{next(_run_ids)}"
        self.on_record = on_record
        info = discover(self.target) if discover_server else {}
        self.model = self.target.model or info.get("model")
        if self.model is None:
            raise ValueError("model: give HttpTarget.model when the server is not asked (/v1/models)")
        self.max_model_len = max_model_len or info.get("max_model_len")
        self.vocab_size = vocab_size or min(info.get("vocab_size") or DEFAULT_VOCAB, 1 << 20)
        spec.validate(self.max_model_len)
        if spec.prompt_source == "text" and tokenizer is None:
            raise ValueError("prompts: 'text' is rendered with the served model's chat template: give its tokenizer "
                             "(or send random ids over HTTP)")
        self.prefix, self.items = build_workload(spec, self.vocab_size, special_ids, tokenizer)
        k, n = shard
        if not (isinstance(n, int) and n >= 1 and isinstance(k, int) and 0 <= k < n):
            raise ValueError(f"shard: must be (k, n) with 0 <= k < n (got {shard!r})")
        if n > 1:       # this process's share of the users (benchmarks split a workload over client processes)
            self.items = [it for it in self.items if it.user % n == k]
        self._init_state()
        self.warm_connections = warm_connections    # open them (GET /v1/models) before the first arrival
        self.status_counts: Counter = Counter()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None

    # ------------------------------------------------------------------ control (LoadRunner's surface)
    def start(self, at: float | None = None) -> "HttpLoadRunner":
        """Send the workload, its arrival times counted from `at` (a time.perf_counter() instant, the same
        clock in every process of this machine; default: now)."""
        self._t_start = time.perf_counter() if at is None else at
        self._thread = threading.Thread(target=self._thread_main, name=f"kvscope-http-load-{self.run_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        aloop, main = self._aloop, self._main
        if aloop is not None and main is not None and not aloop.is_closed():
            try:
                aloop.call_soon_threadsafe(main.cancel)
            except RuntimeError:   # the loop closed meanwhile
                pass

    def progress(self) -> dict:
        p = super().progress()
        with self._lock:
            p.update(target=self.target.v1,
                     http_status={str(k): v for k, v in self.status_counts.items()})   # JSON-safe keys
        return p

    def _summary_extra(self) -> dict:
        with self._lock:
            status = {str(k): v for k, v in sorted(self.status_counts.items(), key=lambda kv: str(kv[0]))}
        return dict(target=self.target.v1, model=self.model, http_status=status)

    # ------------------------------------------------------------------ internals
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception as e:  # noqa: BLE001 - never leave a caller waiting
            log.exception("HTTP load runner failed")
            self.errors.append(f"runner: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._t_end = time.perf_counter()
            self._done.set()

    async def _run(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._main = asyncio.current_task()
        if self._stop.is_set():
            return
        spec = self.spec
        conc = spec.max_concurrency
        sem = asyncio.Semaphore(conc) if conc else None
        turns = max(1, spec.num_turns)
        by_user = self.items_by_user()
        # as many connections as could be open at once
        n_warm = min(len(self.items), conc or len(self.items), 256) if self.warm_connections else 0
        # aiohttp, as `vllm bench serve`: per streamed request it adds about a third of httpx's client-side
        # latency, which the client's TTFT would otherwise count as the server's
        connector = aiohttp.TCPConnector(limit=conc or 0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=self.target.timeout_s, sock_connect=30.0)
        t0 = self._t_start or time.perf_counter()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.target.auth_headers(),
                                         read_bufsize=1 << 20) as client:
            if n_warm:                      # connect ahead: the run then times requests, not TCP set-up
                async def warm() -> None:
                    async with client.get(self.target.v1 + "/models") as r:
                        await r.read()
                await asyncio.gather(*(warm() for _ in range(n_warm)), return_exceptions=True)

            async def user(items: list[LoadItem]) -> None:
                history = list(self.prefix)
                delay = t0 + items[0].arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                for k, it in enumerate(items):
                    prompt = history + it.new_tokens
                    if sem is not None:
                        await sem.acquire()
                    try:
                        with self._lock:
                            self._submitted += 1
                        out_ids = await self._one(client, it, prompt)
                    except asyncio.CancelledError:    # stop(): the connection closes, the server aborts
                        with self._lock:
                            self._failed += 1
                            self.status_counts["cancelled"] += 1
                        raise
                    except Exception as e:  # noqa: BLE001 - one failed request never stops the load
                        status = getattr(e, "status", type(e).__name__)
                        with self._lock:
                            self._failed += 1 + (len(items) - k - 1)   # later turns cannot happen
                            self._submitted += len(items) - k - 1
                            self.status_counts[status] += 1
                            self.errors.append(f"request {it.index}: {e}")
                        return
                    finally:
                        if sem is not None:
                            sem.release()
                    if k + 1 < turns:
                        history = prompt + out_ids
                        if spec.think_time_s:
                            await asyncio.sleep(spec.think_time_s)

            tasks = [asyncio.ensure_future(user(v)) for _, v in sorted(by_user.items())]
            try:
                await asyncio.gather(*tasks)
            except asyncio.CancelledError:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _body(self, it: LoadItem, prompt: list[int]) -> tuple[str, dict]:
        spec, t = self.spec, self.target
        body: dict[str, Any] = {"model": self.model, "max_tokens": it.max_tokens, "temperature": spec.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if spec.seed is not None:
            body["seed"] = spec.seed
        if t.extensions:
            body["ignore_eos"] = spec.ignore_eos
            body["return_token_ids"] = True
        if t.endpoint == "chat":
            text = t.tokenizer.decode(prompt)
            body["messages"] = [{"role": "user", "content": text}]
            return t.v1 + "/chat/completions", body
        body["prompt"] = prompt
        return t.v1 + "/completions", body

    async def _one(self, client: aiohttp.ClientSession, it: LoadItem, prompt: list[int]) -> list[int]:
        url, body = self._body(it, prompt)
        payload = json.dumps(body).encode()
        rid = f"{self.run_id}-u{it.user}t{it.turn}" if self.spec.num_turns > 1 else f"{self.run_id}-{it.index:03d}"
        m = RequestMetrics(arrival_time=time.perf_counter())
        out_ids: list[int] = []
        usage: dict | None = None
        finish = None
        n_chunks = 0
        async with client.post(url, data=payload, headers={"Content-Type": "application/json"}) as r:
            server_arrival = _arrival_stamp(r.headers)
            if r.status != 200:
                raw = (await r.read()).decode("utf-8", "replace")
                try:
                    msg = json.loads(raw)["error"]["message"]
                except Exception:  # noqa: BLE001
                    msg = raw[:200]
                raise _HttpError(r.status, msg)
            async for line in r.content:            # one SSE line at a time (b"data: {...}\n")
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):      # an error after the 200: reported inside the stream
                    err = obj["error"]
                    raise _HttpError(f"stream:{err.get('code') or err.get('type') or 'error'}",
                                     err.get("message", str(err)))
                now = time.perf_counter()
                for ch in obj.get("choices") or []:
                    text = ch.get("text")
                    if text is None:
                        text = (ch.get("delta") or {}).get("content") or ""
                    ids = ch.get("token_ids") or []
                    if text or ids:
                        if m.first_token_time is None:
                            m.first_token_time = now
                        m.token_times.append(now)
                        m.last_token_time = now
                        n_chunks += 1
                    out_ids.extend(ids)
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
                if obj.get("usage"):
                    usage = obj["usage"]
        m.finished_time = time.perf_counter()
        details = (usage or {}).get("prompt_tokens_details") or {}
        m.num_cached_tokens = int(details.get("cached_tokens") or 0)
        out_len = (usage or {}).get("completion_tokens")
        if out_len is None:
            out_len = len(out_ids) or n_chunks
        rec = RequestRecord(request_id=rid, prompt_len=int((usage or {}).get("prompt_tokens") or len(prompt)),
                            output_len=int(out_len), finish_reason=finish or "stop", metrics=m,
                            server_arrival=server_arrival)
        with self._lock:
            self.records.append(rec)
            self._finished += 1
            self.status_counts[200] += 1
        if self.on_record is not None:
            try:
                self.on_record(rec)
            except Exception:  # noqa: BLE001
                log.exception("on_record failed")
        return out_ids


def run_http_load(target: HttpTarget | str, spec: LoadSpec, timeout: float | None = None,
                  **kwargs) -> list[RequestRecord]:
    """Send `spec` to an OpenAI-compatible server and wait: the per-request records (failures are left
    out, as in the in-process runner; see HttpLoadRunner.errors for them)."""
    runner = HttpLoadRunner(target, spec, **kwargs).start()
    if not runner.wait(timeout):
        runner.stop()
        runner.wait(30)
    return list(runner.records)


def format_progress(p: dict) -> str:
    state = "stopped" if p["stopped"] and p["done"] else ("done" if p["done"] else "running")
    codes = ", ".join(f"{k}: {v}" for k, v in sorted(p.get("http_status", {}).items(), key=lambda kv: str(kv[0])))
    return (f"{p['name']} → {p.get('target', 'HTTP')}: {state} — {p['finished']}/{p['total']} finished, "
            f"{p['in_flight']} in flight, {p['failed']} failed/cancelled, {p['elapsed_s']:.1f} s"
            + (f" (HTTP {codes})" if codes else ""))


__all__ = ["HttpTarget", "HttpLoadRunner", "run_http_load", "discover", "format_progress"]
