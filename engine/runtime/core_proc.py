"""The engine core in its own process (vLLM's EngineCoreProc): an EngineLoop whose outputs leave through a
local socket (a multiprocessing Connection), one message per engine step, to the `EngineCoreClient` in the serving process.

Several serving processes may attach (`api_server --api-server-count N`): the core then holds one pipe per
client, remembers which pipe added each request, and sends each client its own requests' outputs (and the
engine's stats) once per step. A client that leaves ("shutdown" or EOF) has its unfinished requests aborted;
the core exits when the last one has left.

The serving process keeps HTTP, JSON, SSE and tokenization; this process keeps scheduling, the model and
detokenization. Neither waits on the other's GIL. Messages are tuples of plain values encoded with
`marshal` (never pickle):

    client -> core  ("add", [(request_id, prompt_ids, sampling params dict, arrival_time), ...])
                    ("abort", [request_id, ...])      ("shutdown",): this client leaves
    core -> client  ("ready", info)   ("failed", message)
                    ("out", [encoded output, ...], stats)      ("error", request_id, kind, message)

Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux, one clock for every process of the machine),
so arrival stamps taken by the server and the engine's own stamps compare directly.
"""
from __future__ import annotations

import dataclasses
import logging
import marshal
import os
import queue
import threading
from multiprocessing.connection import wait
import time

from engine.runtime.async_engine import EngineLoop
from engine.runtime.gc_utils import freeze_gc_heap
from engine.runtime.process_name import set_process_name
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def encode_output(out: RequestOutput, lp_from: int, first: bool) -> tuple:
    """What the client needs of one output: deltas, and the full stamps once the request finished; `first`:
    the request's first output, which carries its prompt logprobs."""
    m = out.metrics
    metrics = dataclasses.astuple(m) if out.finished else None
    lps = None
    if out.logprobs is not None:
        lps = [[(e.token_id, e.logprob, e.decoded) for e in entry] for entry in out.logprobs[lp_from:]]
    plps = None                 # prompt logprobs: complete before the first token, sent with it
    if out.prompt_logprobs is not None and first:
        plps = [None if e is None else [(x.token_id, x.logprob, x.decoded, x.rank) for x in e]
                for e in out.prompt_logprobs]
    return (out.request_id, out.delta_text, list(out.delta_token_ids), out.finished, out.finish_reason,
            out.stop_reason, out.num_cached_tokens, m.first_token_time, lps, metrics, plps)


class CoreLoop(EngineLoop):
    """An EngineLoop that hands each step's outputs to the pipes of the clients that added the requests,
    instead of per-request streams."""

    def __init__(self, config: EngineConfig, conns: list):
        super().__init__(config)
        self.engine.output_processor.delta_outputs = True      # encoded at once: the client accumulates
        self.conns = list(conns)
        self._owner: dict[str, object] = {}        # request id -> the pipe of the client that added it
        self._lp_sent: dict[str, int] = {}        # logprob entries sent, of requests that asked for them
        self._started: set[str] = set()            # requests with prompt logprobs whose first output went
        # The engine thread only enqueues: a busy client that is slow to read must never stall a step.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="kvscope-core-sender", daemon=True)
        self._sender.start()

    def send(self, msg: tuple, conn=None) -> None:
        """Queue `msg` for one client's pipe (None: every client's)."""
        for c in (self.conns if conn is None else [conn]):
            self._outbox.put((c, msg))

    def _send_loop(self) -> None:
        gone: set[int] = set()
        while True:
            item = self._outbox.get()
            if item is None:
                return
            conn, msg = item
            if id(conn) in gone:
                continue
            if msg is None:                         # detached: after what was queued before, close its pipe
                gone.add(id(conn))
                conn.close()
                continue
            try:
                conn.send_bytes(marshal.dumps(msg))
            except (OSError, ValueError):           # that client is gone
                gone.add(id(conn))

    def add(self, conn, rid: str, prompt, params: dict, arrival: float) -> None:
        """A client's request: remembered as that client's, then submitted (an invalid one: an error to it)."""
        with self._inbox_lock:
            taken = rid in self._owner
            if not taken:
                self._owner[rid] = conn
        if taken:                                   # another client's request has this id: never reroute it
            self.send(("error", rid, "ValueError", f"request_id: {rid!r} is already in use"), conn)
            return
        try:
            self.submit(prompt, SamplingParams(**params), request_id=rid, arrival_time=arrival)
        except Exception as e:  # noqa: BLE001 - one bad request never stops the core
            with self._inbox_lock:
                self._owner.pop(rid, None)
            self.send(("error", rid, type(e).__name__, str(e)), conn)

    def detach(self, conn) -> None:
        """A client left: abort its unfinished requests and send it nothing more."""
        with self._inbox_lock:
            mine = [rid for rid, c in self._owner.items() if c is conn]
            if conn in self.conns:
                self.conns.remove(conn)
        self._outbox.put((conn, None))              # the client's receiver sees EOF and ends
        for rid in mine:
            self.abort(rid)

    def close_sender(self) -> None:
        self._outbox.put(None)
        self._sender.join(10)

    def metrics_stats(self) -> dict:
        """metrics_snapshot() in the plain types marshal can send (called on the engine thread)."""
        return {k: v for k, v in self.metrics_snapshot().items() if isinstance(v, (int, float, str, list))}

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_conn: dict[int, tuple[object, list]] = {}
        with self._inbox_lock:
            owners = [self._owner.get(out.request_id) for out in outputs]
        for out, conn in zip(outputs, owners):
            rid = out.request_id
            sent = self._lp_sent.get(rid, 0)
            first = out.prompt_logprobs is not None and rid not in self._started
            if conn is not None:
                by_conn.setdefault(id(conn), (conn, []))[1].append(encode_output(out, sent, first))
            if out.logprobs is not None:
                self._lp_sent[rid] = len(out.logprobs)
            if first:
                self._started.add(rid)
            if out.finished:
                self._lp_sent.pop(rid, None)
                self._started.discard(rid)
                with self._inbox_lock:
                    self._streams.pop(rid, None)
                    self._owner.pop(rid, None)
        if by_conn:
            stats = self.metrics_stats()
            with self._inbox_lock:
                conns = list(self.conns)
            for conn in conns:                      # every client: its outputs (maybe none) and fresh stats
                self.send(("out", by_conn.get(id(conn), (conn, []))[1], stats), conn)

    def _close(self, request_id: str, err: BaseException) -> None:
        self._lp_sent.pop(request_id, None)
        self._started.discard(request_id)
        with self._inbox_lock:
            self._streams.pop(request_id, None)
            conn = self._owner.pop(request_id, None)
        if conn is not None:
            self.send(("error", request_id, type(err).__name__, str(err)), conn)


def watch_parent(ppid: int) -> None:
    """Exit when the serving process that started this one is gone."""
    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != ppid:
                os._exit(1)
    threading.Thread(target=watch, name="kvscope-core-parent", daemon=True).start()


def core_main(config: dict, conns) -> None:
    """The child process: build the engine, say ready (or why not) on every client's pipe, then serve the
    pipes until the last client has left. `conns`: one pipe, or a list of them (one per serving process)."""
    set_process_name("kvscope-core")
    logging.basicConfig(level=logging.WARNING)
    conns = list(conns) if isinstance(conns, (list, tuple)) else [conns]
    try:
        loop = CoreLoop(EngineConfig(**config), conns)
    except BaseException as e:  # noqa: BLE001 - reported to the clients, which raise it
        for conn in conns:
            try:
                conn.send_bytes(marshal.dumps(("failed", f"{type(e).__name__}: {e}")))
            except (OSError, ValueError):
                pass
        return
    eng = loop.engine
    info = {"config": eng.config.to_dict(), "model_name": eng.model_name, "max_model_len": eng.max_model_len,
            "num_blocks": eng.num_blocks, "block_size": eng.block_size, "vocab_size": eng.arch_config.vocab_size,
            "eos_token_ids": sorted(eng.eos_token_ids), "stats": loop.metrics_stats(),
            "quantization": eng.quantization, "weight_summary": eng.weight_summary}
    loop.send(("ready", info))
    freeze_gc_heap()
    loop.start()
    live = list(conns)
    try:
        while live:
            for conn in wait(live):
                try:
                    msg = marshal.loads(conn.recv_bytes())
                except (EOFError, OSError):          # that client went away
                    msg = ("shutdown",)
                kind = msg[0]
                if kind == "add":
                    for rid, prompt, params, arrival in msg[1]:
                        loop.add(conn, rid, prompt, params, arrival)
                elif kind == "abort":
                    for rid in msg[1]:
                        loop.abort(rid)
                elif kind == "shutdown":
                    live.remove(conn)
                    loop.detach(conn)
    finally:
        loop.shutdown()
        loop.close_sender()
        eng.close()
