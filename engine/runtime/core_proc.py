"""The engine core in its own process (vLLM's EngineCoreProc): an EngineLoop whose outputs leave through a
pipe, one message per engine step, to the `EngineCoreClient` in the serving process.

The serving process keeps HTTP, JSON, SSE and tokenization; this process keeps scheduling, the model and
detokenization. Neither waits on the other's GIL. Messages are tuples of plain values encoded with
`marshal` (never pickle):

    client -> core  ("add", [(request_id, prompt_ids, sampling params dict, arrival_time), ...])
                    ("abort", [request_id, ...])      ("shutdown",)
    core -> client  ("ready", info)   ("failed", message)
                    ("out", [encoded output, ...], stats)      ("error", request_id, kind, message)

Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux, one clock for every process of the machine),
so arrival stamps taken by the server and the engine's own stamps compare directly.
"""
from __future__ import annotations

import dataclasses
import logging
import marshal
import queue
import threading

from engine.runtime.async_engine import EngineLoop
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def encode_output(out: RequestOutput, lp_from: int) -> tuple:
    """What the client needs of one output: deltas, and the full stamps once the request finished."""
    m = out.metrics
    metrics = dataclasses.astuple(m) if out.finished else None
    lps = None
    if out.logprobs is not None:
        lps = [[(e.token_id, e.logprob, e.decoded) for e in entry] for entry in out.logprobs[lp_from:]]
    plps = None                 # prompt logprobs: complete before the first token, sent with it
    if out.prompt_logprobs is not None and len(out.token_ids) == len(out.delta_token_ids):
        plps = [None if e is None else [(x.token_id, x.logprob, x.decoded, x.rank) for x in e]
                for e in out.prompt_logprobs]
    return (out.request_id, out.delta_text, list(out.delta_token_ids), out.finished, out.finish_reason,
            out.stop_reason, out.num_cached_tokens, m.first_token_time, lps, metrics, plps)


class CoreLoop(EngineLoop):
    """An EngineLoop that hands each step's outputs to the pipe instead of per-request streams."""

    def __init__(self, config: EngineConfig, conn):
        super().__init__(config)
        self.conn = conn
        self._lp_sent: dict[str, int] = {}
        # The engine thread only enqueues: a busy client that is slow to read must never stall a step.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="kvscope-core-sender", daemon=True)
        self._sender.start()

    def send(self, msg: tuple) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self.conn.send_bytes(marshal.dumps(msg))
            except (OSError, ValueError):           # the client is gone
                return

    def close_sender(self) -> None:
        self._outbox.put(None)
        self._sender.join(10)

    def metrics_stats(self) -> dict:
        """metrics_snapshot() in the plain types marshal can send (called on the engine thread)."""
        return {k: v for k, v in self.metrics_snapshot().items() if isinstance(v, (int, float, str, list))}

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        enc = []
        for out in outputs:
            rid = out.request_id
            sent = self._lp_sent.get(rid, 0)
            enc.append(encode_output(out, sent))
            if out.logprobs is not None:
                self._lp_sent[rid] = len(out.logprobs)
            if out.finished:
                self._lp_sent.pop(rid, None)
                with self._inbox_lock:
                    self._streams.pop(rid, None)
        if enc:
            self.send(("out", enc, self.metrics_stats()))

    def _close(self, request_id: str, err: BaseException) -> None:
        with self._inbox_lock:
            self._streams.pop(request_id, None)
        self.send(("error", request_id, type(err).__name__, str(err)))


def core_main(config: dict, conn) -> None:
    """The child process: build the engine, say ready (or why not), then serve the pipe until EOF."""
    logging.basicConfig(level=logging.WARNING)
    try:
        loop = CoreLoop(EngineConfig(**config), conn)
    except BaseException as e:  # noqa: BLE001 - reported to the client, which raises it
        conn.send_bytes(marshal.dumps(("failed", f"{type(e).__name__}: {e}")))
        return
    eng = loop.engine
    info = {"config": eng.config.to_dict(), "model_name": eng.model_name, "max_model_len": eng.max_model_len,
            "num_blocks": eng.num_blocks, "block_size": eng.block_size, "vocab_size": eng.arch_config.vocab_size,
            "eos_token_ids": sorted(eng.eos_token_ids), "stats": loop.metrics_stats(),
            "quantization": eng.quantization, "weight_summary": eng.weight_summary}
    loop.send(("ready", info))
    loop.start()
    try:
        while True:
            try:
                msg = marshal.loads(conn.recv_bytes())
            except (EOFError, OSError):          # the client went away: stop
                break
            kind = msg[0]
            if kind == "add":
                for rid, prompt, params, arrival in msg[1]:
                    try:
                        loop.submit(prompt, SamplingParams(**params), request_id=rid, arrival_time=arrival)
                    except Exception as e:  # noqa: BLE001 - one bad request never stops the core
                        loop.send(("error", rid, type(e).__name__, str(e)))
            elif kind == "abort":
                for rid in msg[1]:
                    loop.abort(rid)
            elif kind == "shutdown":
                break
    finally:
        loop.shutdown()
        loop.close_sender()
        eng.close()
