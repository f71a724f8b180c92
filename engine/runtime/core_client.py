"""EngineCoreClient: EngineLoop's serving surface with the engine in a child process (`core_proc.py`),
started as `python -m engine.runtime.core_main` (a fresh interpreter: the caller's script is not imported again).

What the OpenAI server calls on an EngineLoop (`submit_many`, `submit`, `abort`, `stats`,
`metrics_snapshot`, `shutdown`, and `engine` for validation and tokenization) works the same here:
`engine` is a `FrontendEngine` (the tokenizer, the limits, `make_sequence`'s checks) and each request's
outputs arrive in an ordinary `RequestStream`. One receiver thread reads the connection and hands each step's
outputs to the event loops that follow them, one `call_soon_threadsafe` per step.

The text of a request without stop strings is decoded here, from the token ids the engine sends (as vLLM's front
end does): the engine process is sent `detokenize=False`, so its one thread, which every request's next token
waits on, does none of it; with several API server processes the decoding is spread over them. A request with
stop strings is decoded in the engine, which must see the text to stop.

If the engine process dies, every open stream fails at once with a clear error (clients see it within
the receiver's poll interval), the client reports itself unhealthy, starts a fresh engine process, and
serves again once it is ready.

`EngineCoreClient(config, attach=conn, reattach=fn)` instead attaches to an engine process started by someone else
(the launcher of several API server processes, `api_server --api-server-count N`), through that process's pipe
for this client; it never starts one: if the engine dies, this client fails its open requests, stays unhealthy,
and calls `reattach()` for the pipe of the engine process that replaces it (the launcher starts one).
"""
from __future__ import annotations

import itertools
import logging
import marshal
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from multiprocessing.connection import Listener
from pathlib import Path
from dataclasses import asdict
from types import SimpleNamespace

from engine.runtime.async_engine import _END, EngineLoop, RequestStream, _call_soon, _put_many, admit_batch
from engine.config import EngineConfig
from engine.ipc import set_nodelay
from engine.runtime.detokenizer import Detokenizer
from engine.runtime.input_processor import InputProcessor
from engine.runtime.llm_engine import EngineOverloaded, LLMEngine
from engine.models.loader import load_tokenizer, resolve
from engine.structured.compiler import GrammarCompiler
from engine.outputs import Logprob, RequestMetrics, RequestOutput
from engine.core.sequence import Sequence

log = logging.getLogger(__name__)


class EngineDied(RuntimeError):
    """The engine process exited while requests were in flight."""


class FrontendEngine:
    """The parts of an LLMEngine the serving process needs: limits, tokenizer, request validation."""

    tokenize = LLMEngine.tokenize
    apply_chat_template = LLMEngine.apply_chat_template
    make_sequence = LLMEngine.make_sequence

    def __init__(self, info: dict, tokenizer):
        self.config = EngineConfig(**info["config"])
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.num_blocks = info["num_blocks"]
        self.block_size = info["block_size"]
        self.arch_config = SimpleNamespace(vocab_size=info["vocab_size"])
        self.eos_token_ids = set(info["eos_token_ids"])
        self.quantization, self.weight_summary = info["quantization"], info["weight_summary"]
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, info["vocab_size"], self.max_model_len, self.block_size,
                                              self.num_blocks,
                                              GrammarCompiler(tokenizer, info["vocab_size"], self.eos_token_ids),
                                              self.eos_token_ids)


class _Acc:
    """A request's output so far, rebuilt from the core's deltas; `detok`: the sequence whose text is decoded here
    (None: the engine sends the text)."""
    __slots__ = ("prompt", "prompt_ids", "text", "token_ids", "logprobs", "metrics", "prompt_logprobs", "detok")

    def __init__(self, seq: Sequence, detok: Detokenizer | None):
        self.prompt, self.prompt_ids = seq.prompt, seq.prompt_token_ids
        self.text, self.token_ids = "", []
        self.logprobs = [] if seq.params.logprobs is not None else None
        self.metrics = seq.metrics
        self.prompt_logprobs = None
        self.detok = None
        if detok is not None:
            self.detok = Sequence(seq.request_id, None, seq.prompt_token_ids, seq.params, 0.0)
            detok.start(self.detok)


class _CoreProcess:
    """The engine process: `python -m engine.runtime.core_main`, a fresh interpreter (the caller's script is not
    imported again, so no `if __name__ == "__main__"` guard is needed), connected back over a local socket.
    Its stderr is echoed and its tail kept for the error that reports its death."""

    def __init__(self, config: dict, timeout: float):
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, KVSCOPE_CORE_ADDRESS=f"127.0.0.1:{listener.address[1]}",
                   KVSCOPE_CORE_AUTHKEY=key.hex(), KVSCOPE_CORE_PARENT=str(os.getpid()),
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.popen = subprocess.Popen([sys.executable, "-m", "engine.runtime.core_main"], env=env,
                                      stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.tail: deque[str] = deque(maxlen=20)
        threading.Thread(target=self._read, name="kvscope-core-stderr", daemon=True).start()
        box: list = []

        def accept():
            try:
                box.append(listener.accept())
            except OSError:                 # closed: the process never connected
                pass
        t = threading.Thread(target=accept, daemon=True)
        t.start()
        end = time.monotonic() + timeout
        while t.is_alive() and self.is_alive() and time.monotonic() < end:
            t.join(0.1)
        listener.close()
        if not box:
            self.kill()
            raise RuntimeError(f"the engine process did not connect (exit code {self.exitcode})" + self.stderr_note())
        self.conn = box[0]
        set_nodelay(self.conn)
        self.conn.send_bytes(marshal.dumps(config))

    def _read(self) -> None:
        for raw in self.popen.stderr:
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)

    def stderr_note(self) -> str:
        return ("\n--- engine process stderr (last lines) ---\n" + "\n".join(self.tail)) if self.tail else ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()


class EngineCoreClient:
    def __init__(self, config: EngineConfig | None = None, start_timeout: float = 900.0, attach=None,
                 reattach=None, **overrides):
        config = EngineConfig.of(config, **overrides)
        self.requested_config = config
        self.start_timeout = start_timeout
        self._inbox_lock = threading.Lock()       # streams, accumulators, the pipe's send side
        self._streams: dict[str, RequestStream] = {}
        self._acc: dict[str, _Acc] = {}
        self._ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:8]     # unnamed requests: unique across the clients of one core
        self._stop = False
        self._stats: dict = {}
        self._sent_since_stats = 0                # requests sent after the latest stats the core reported
        self.restarts = 0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        tok_folder = None if config.model_config.skip_tokenizer_init else resolve(config.model_config.model)[2]
        self._tokenizer = load_tokenizer(tok_folder)
        self._detok = Detokenizer(self._tokenizer)
        self.proc = None                          # the engine process, when this client started it
        self._reattach = reattach                 # attached: blocks until the next engine process's pipe
        if attach is not None:
            self._conn = attach
            self._wait_ready(lambda: None)
        else:
            self._spawn()

    # ---- the engine process ----------------------------------------------------------------------
    def _spawn(self) -> None:
        self.proc = _CoreProcess(self.requested_config.to_dict(), self.start_timeout)
        self._conn = self.proc.conn

        def check() -> None:
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (exit code {self.proc.exitcode})"
                                   + self.proc.stderr_note())
        self._wait_ready(check)

    def _wait_ready(self, check) -> None:
        """Wait for the engine's "ready" (calling `check()` meanwhile), then start receiving."""
        t_end = time.monotonic() + self.start_timeout
        while not self._conn.poll(0.2):
            check()
            if time.monotonic() > t_end:
                if self.proc is not None:
                    self.proc.kill()
                raise RuntimeError(f"the engine process was not ready within {self.start_timeout:.0f} s")
        try:
            msg = marshal.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise RuntimeError("the engine process closed its pipe during start-up")
        if msg[0] == "failed":
            if self.proc is not None:
                self.proc.join(5)
            raise ValueError(msg[1]) if msg[1].startswith("ValueError") else RuntimeError(msg[1])
        info = msg[1]
        self.engine = FrontendEngine(info, self._tokenizer)
        self._stats = info["stats"]
        self._thread = threading.Thread(target=self._receive, name="kvscope-core-client", daemon=True)
        self._thread.start()
        self._ready.set()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "EngineCoreClient":
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def healthy(self) -> bool:
        return self._ready.is_set() and (self.proc is None or self.proc.is_alive()) and not self._stop

    # ---- requests --------------------------------------------------------------------------------
    submit = EngineLoop.submit                  # one request: submit_many of one
    generate = EngineLoop.generate

    def submit_many(self, requests: list[tuple], arrival_time: float | None = None) -> list[RequestStream]:
        """Validate and tokenize here, then hand the whole batch to the engine process in one message."""
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        if self._stop:
            raise RuntimeError("engine shut down")
        if not self._ready.is_set():
            raise RuntimeError("the engine process is restarting")
        eng = self.engine
        seqs = [eng.make_sequence(p, sp, rid if rid is not None else "pending", arrival) for p, sp, rid in requests]
        return self.submit_sequences(seqs, [rid for _, _, rid in requests])

    def submit_sequences(self, seqs: list[Sequence], request_ids: list[str | None]) -> list[RequestStream]:
        """Hand validated sequences (make_sequence) to the engine process in one message; request_ids: the
        caller's ids, None where the client names the request."""
        if self._stop:
            raise RuntimeError("engine shut down")
        if not self._ready.is_set():
            raise RuntimeError("the engine process is restarting")
        eng = self.engine
        with self._inbox_lock:
            admit_batch(seqs, request_ids, self._streams,
                        eng.config.scheduler_config.max_waiting_requests,
                        # never more than the requests open here (the core's stats may be a step old)
                        min(self._stats.get("num_waiting", 0) + self._sent_since_stats, len(self._streams)),
                        lambda: f"core-{self._id_prefix}-{next(self._ids)}")
            streams = []
            sent = []
            for seq in seqs:
                stream = RequestStream(self, seq.request_id)
                self._streams[seq.request_id] = stream
                params = asdict(seq.params)
                here = self._tokenizer is not None and seq.params.detokenize and not seq.params.stop
                params["detokenize"] = seq.params.detokenize and not here      # decoded here, not in the engine
                self._acc[seq.request_id] = _Acc(seq, self._detok if here else None)
                streams.append(stream)
                sent.append((seq.request_id, seq.prompt_token_ids, params, seq.metrics.arrival_time))
            msg = ("add", sent)
            try:
                self._conn.send_bytes(marshal.dumps(msg))
                self._sent_since_stats += len(seqs)
            except (OSError, ValueError) as e:
                for seq in seqs:
                    self._streams.pop(seq.request_id, None)
                    self._acc.pop(seq.request_id, None)
                raise RuntimeError(f"the engine process is not reachable: {e}")
        return streams

    def abort(self, request_id: str) -> None:
        with self._inbox_lock:
            if request_id not in self._streams:
                return
            try:
                self._conn.send_bytes(marshal.dumps(("abort", [request_id])))
            except (OSError, ValueError):
                pass                               # the process is gone; its streams fail on their own

    def stats(self) -> dict:
        return dict(self._stats)

    @property
    def num_open(self) -> int:
        """Requests sent and not yet finished (a data-parallel router's load)."""
        return len(self._streams)

    metrics_snapshot = stats                    # the core's latest stats: no step to wait for here

    # ---- the receiver thread ---------------------------------------------------------------------
    def _receive(self) -> None:
        conn = self._conn
        while True:
            try:
                msg = marshal.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if msg[0] == "out":
                self._stats = msg[2]
                self._sent_since_stats = 0
                self._deliver(msg[1])
            elif msg[0] == "error":
                _, rid, kind, text = msg
                err = (EngineOverloaded if kind == "EngineOverloaded" else
                       ValueError if kind == "ValueError" else RuntimeError)(text)
                self._fail(rid, err)
        self._on_exit()

    def _deliver(self, encoded: list) -> None:
        batches: dict = {}
        for rid, delta_text, delta_ids, finished, reason, stop_reason, cached, first_tok, lps, metrics, plps \
                in encoded:
            with self._inbox_lock:
                acc = self._acc.get(rid)
                stream = self._streams.get(rid)
                if finished:
                    self._acc.pop(rid, None)
                    self._streams.pop(rid, None)
            if acc is None or stream is None:
                continue
            if acc.detok is not None:
                acc.detok.token_ids.extend(delta_ids)
                delta_text = self._detok.update(acc.detok)
            acc.text += delta_text
            acc.token_ids = acc.token_ids + delta_ids
            if lps is not None and acc.logprobs is not None:
                acc.logprobs.extend([Logprob(*e) for e in entry] for entry in lps)
            if plps is not None:
                acc.prompt_logprobs = [None if e is None else [Logprob(*x) for x in e] for e in plps]
            if metrics is not None:
                acc.metrics = RequestMetrics(*metrics)
            elif acc.metrics.first_token_time is None:
                acc.metrics.first_token_time = first_tok
            out = RequestOutput(request_id=rid, prompt=acc.prompt, prompt_token_ids=acc.prompt_ids, text=acc.text,
                                token_ids=acc.token_ids, delta_text=delta_text, delta_token_ids=delta_ids,
                                finished=finished, finish_reason=reason, metrics=acc.metrics,
                                logprobs=acc.logprobs, stop_reason=stop_reason, num_cached_tokens=cached,
                                prompt_logprobs=acc.prompt_logprobs)
            stream._put(out, batches)
            if finished:
                stream._put(_END, batches)
        for aloop, items in batches.items():
            _call_soon(aloop, _put_many, items)

    def _fail(self, rid: str, err: BaseException) -> None:
        with self._inbox_lock:
            stream = self._streams.pop(rid, None)
            self._acc.pop(rid, None)
        if stream is not None:
            stream._put(err)
            stream._put(_END)

    def _on_exit(self) -> None:
        """The pipe closed: fail every open request; unless shutting down, start a new engine process."""
        self._ready.clear()
        with self._inbox_lock:
            open_ids = list(self._streams)
        err = RuntimeError("engine shut down") if self._stop else \
            EngineDied("the engine process exited; it is being restarted")
        for rid in open_ids:                      # first: clients learn at once, before any join
            self._fail(rid, err)
        if self.proc is None:                     # attached: the launcher owns the engine process
            self.error = None if self._stop else err
            if self._stop or self._reattach is None:
                return
            self._stats, self._sent_since_stats = {}, 0
            while not self._stop:
                try:
                    conn = self._reattach()       # the launcher's next engine process (None: it is shutting down)
                except (EOFError, OSError):
                    return
                if conn is None or self._stop:
                    return
                self._conn = conn
                self.restarts += 1
                try:
                    self._wait_ready(lambda: None)    # starts a new receiver thread
                except Exception as e:  # noqa: BLE001 - that process failed to start: wait for the next one
                    self.error = e
                    log.exception("the restarted engine process failed to start")
                    continue
                log.warning("attached to a restarted engine process")
                return
        self.proc.join(5)
        if self._stop:
            return
        self.error = err
        log.error("%s (exit code %s)%s", err, self.proc.exitcode, self.proc.stderr_note())
        self._stats, self._sent_since_stats = {}, 0
        while not self._stop:
            try:
                self.restarts += 1
                self._spawn()                     # starts a new receiver thread
                log.warning("engine process restarted (pid %s)", self.proc.pid)
                return
            except Exception as e:  # noqa: BLE001 - keep trying; /health says unhealthy meanwhile
                self.error = e
                log.exception("engine restart failed; retrying in 5 s")
                time.sleep(5)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        try:
            with self._inbox_lock:
                self._conn.send_bytes(marshal.dumps(("shutdown",)))
        except (OSError, ValueError):
            pass
        if self.proc is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
