"""The connection guard: read timeouts, a cap on open connections, OpenAI-shaped errors for malformed HTTP.

uvicorn (h11) leaves a connection open for as long as its client likes while it sends nothing, half a
request line, or headers and part of a body; enough of them exhaust the file-descriptor limit, and then
every `accept()` fails. `guarded_protocol(limits)` returns uvicorn's HTTP protocol (with arrival stamps,
arrival.py) plus what production servers do:

- header timeout: a connection must deliver a request's complete headers within `header_timeout_s` of
  opening (or of its previous response): otherwise 408 if it sent something, else it is closed silently.
- body timeout: while a request's body is incomplete, `body_timeout_s` at most between reads: 408, closed.
- keep-alive: an idle kept-alive connection is closed after `keep_alive_s` (uvicorn's timeout_keep_alive).
- a cap on open connections (`max_connections`, by default below the file-descriptor limit): a new
  connection over it closes the oldest idle one (no request in progress), as nginx reuses its idle
  connections; when none is idle, the newcomer gets 503 and is closed. One warning line a minute says so.
- malformed HTTP (`Content-Length: abc`, a garbage request line, headers over `max_header_bytes`) gets an
  OpenAI-style JSON 400 (431 for headers too large) instead of uvicorn's plain text.
- request buffering, as nginx does: a request's headers and a body of up to `hold_body_bytes` are read whole
  before uvicorn parses them, so a client that stalls inside them costs a buffer and a timer, never a request
  in the app (where a connection flood's partial bodies would otherwise spend the event loop's time). One
  that times out or goes away is handed on then, and answered and counted as before (408, 499).
- a client that half-closes its side after a complete request still gets its response (then the
  connection closes); uvicorn would treat the half-close as a disconnect and answer nothing. A client that
  closed fully is told apart by the reset its kernel sends back to a `102 Processing` probe.

    uvicorn.run(app, http=guarded_protocol(HttpLimits()), timeout_keep_alive=limits.keep_alive_s, ...)
"""
from __future__ import annotations

import dataclasses
import json
import logging
import resource
import socket
import time
from collections import OrderedDict

import h11

from engine.entrypoints.openai.arrival import ArrivalProtocol

log = logging.getLogger(__name__)

# file descriptors kept for everything but counted client connections: engine pipes, files, logs, outgoing calls,
# and the sockets in transit under a connection flood (accepted in batches before the guard counts them, closed
# by it one loop iteration after it decides); an eighth of the limit, at least 256. A full table makes asyncio's
# accept fail (EMFILE) and pause accepting for a second
FD_RESERVE_MIN, FD_RESERVE_FRACTION = 256, 8
WARN_EVERY_S = 60.0
PROBE_FIRST_S, PROBE_S = 0.01, 0.5     # after a 102 probe, check for a reset this soon, backing off to this


def set_ulimit(target_soft_limit: int = 65535) -> int:
    """Raise this process's soft limit on open files towards `target_soft_limit` (never over the hard
    limit), as vLLM's server does; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target_soft_limit if hard == resource.RLIM_INFINITY else min(target_soft_limit, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def default_max_connections() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(soft - max(FD_RESERVE_MIN, soft // FD_RESERVE_FRACTION), 65536))


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """Timeouts and caps of the connection guard (see the module docstring); None: no limit."""
    header_timeout_s: float | None = 10.0
    body_timeout_s: float | None = 30.0
    keep_alive_s: float = 5.0
    max_connections: int | None = None        # None: the open-file limit less an eighth, read at start
    max_header_bytes: int = 64 << 10
    hold_body_bytes: int = 1 << 20            # larger bodies stream into the app as they arrive

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name}: must be > 0 seconds or None (got {v!r})")
        if not (isinstance(self.keep_alive_s, (int, float)) and self.keep_alive_s > 0):
            raise ValueError(f"keep_alive_s: must be > 0 seconds (got {self.keep_alive_s!r})")
        if self.max_connections is not None and not (isinstance(self.max_connections, int)
                                                     and self.max_connections >= 1):
            raise ValueError(f"max_connections: must be None or an int >= 1 (got {self.max_connections!r})")
        if not (isinstance(self.max_header_bytes, int) and self.max_header_bytes >= 1024):
            raise ValueError(f"max_header_bytes: must be an int >= 1024 (got {self.max_header_bytes!r})")
        if not (isinstance(self.hold_body_bytes, int) and self.hold_body_bytes >= 0):
            raise ValueError(f"hold_body_bytes: must be an int >= 0 (got {self.hold_body_bytes!r})")

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config / uvicorn.run keyword arguments: this guard's protocol and uvicorn's own limits."""
        return dict(http=guarded_protocol(self), timeout_keep_alive=self.keep_alive_s,
                    h11_max_incomplete_event_size=self.max_header_bytes)


def held_body_length(head: bytes) -> int | None:
    """The Content-Length of a request head whose body may be held back; None where uvicorn should see the
    request at once: no length, chunked, `Expect: 100-continue` (the client waits for an answer first), a
    malformed or repeated length (h11 refuses it)."""
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if name in (b"transfer-encoding", b"expect"):
            return None
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
    return length


def raw_error(status: int, message: str, type_: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-style JSON error, for writing past the h11 state machine."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
              503: b"Service Unavailable"}[status]
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            % (status, reason, len(body)) + body)


class _Shared:
    """Per-server state: connections with no request in progress, oldest first; the warning's counters."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.idle: OrderedDict[int, "GuardedProtocol"] = OrderedDict()
        self.shed = self.refused = 0
        self.warned_at = 0.0

    def note(self, what: str, n_open: int) -> None:
        if what == "shed":
            self.shed += 1
        else:
            self.refused += 1
        now = time.monotonic()
        if now - self.warned_at >= WARN_EVERY_S:
            log.warning("connection limit reached (max_connections=%d, %d open): closed %d idle connection(s) "
                        "and refused %d since the last warning", self.max_connections, n_open, self.shed,
                        self.refused)
            self.warned_at, self.shed, self.refused = now, 0, 0


class GuardedProtocol(ArrivalProtocol):
    limits: HttpLimits = HttpLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shared = getattr(self.server_state, "kvscope_guard", None)
        if shared is None:
            shared = _Shared(self.limits.max_connections or default_max_connections())
            self.server_state.kvscope_guard = shared
        self._shared: _Shared = shared
        self._timer = None
        self._got_bytes = False          # bytes of a next request received (header timeout: 408, not silence)
        self._half_closed = False
        self._probe_timer = None
        self._checked = None             # the request cycle whose header size was checked
        self._held: bytearray | None = None   # a next request's bytes, until its headers and body are complete
        self._held_t = 0.0               # when its first byte came
        self._held_need = -1             # the held request's whole size once its headers are in (-1: not yet)
        next_event = self.conn.next_event

        def next_event_noting_errors():  # keep h11's reason and status hint for send_400_response
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._protocol_error = e
                raise
        self._protocol_error: h11.RemoteProtocolError | None = None
        self.conn.next_event = next_event_noting_errors

    # ---- state ------------------------------------------------------------------------------------
    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self, seconds: float | None, handler) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if seconds is not None and not self.transport.is_closing():
            self._timer = self.loop.call_later(seconds, handler)

    def _set_idle(self, idle: bool) -> None:
        if idle:
            self._shared.idle[id(self)] = self
        else:
            self._shared.idle.pop(id(self), None)

    def _update(self) -> None:
        """After bytes came in or a response went out: which timer runs, whether this connection is idle."""
        if self._in_request():
            self._set_idle(False)
            self._got_bytes = False
            if self.cycle is not self._checked:       # a new request: its headers' size, once
                self._checked = self.cycle
                if self._header_size() > self.limits.max_header_bytes:
                    self._refuse_headers()
                    return
            if self.cycle.more_body or self.conn.their_state is h11.SEND_BODY:
                self._arm(self.limits.body_timeout_s, self._body_timeout)
            else:
                self._arm(None, None)
        else:
            self._set_idle(True)
            if self._timer is None:
                self._arm(self.limits.header_timeout_s, self._header_timeout)

    def _header_size(self) -> int:
        return len(self.scope.get("raw_path", b"")) + len(self.scope.get("query_string", b"")) + \
            sum(len(k) + len(v) + 4 for k, v in self.headers or ())

    def _refuse_headers(self) -> None:
        """Complete headers over max_header_bytes (h11 only limits incomplete ones): 431; the request's ASGI
        task, already scheduled, sees a disconnect and its responses go nowhere."""
        self.cycle.scope.setdefault("state", {})["kvscope_status"] = 431
        self.cycle.disconnected = True
        self.cycle.message_event.set()
        self.transport.write(raw_error(431, f"request headers too large (at most {self.limits.max_header_bytes} "
                                            "bytes)", "invalid_request_error", "headers_too_large"))
        self._close_quietly()

    # ---- asyncio protocol ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        shared = self._shared
        if len(self.connections) > shared.max_connections:
            if shared.idle:
                _, oldest = shared.idle.popitem(last=False)
                oldest._close_quietly()
                shared.note("shed", len(self.connections))
            else:
                transport.write(raw_error(503, f"too many open connections (max_connections="
                                               f"{shared.max_connections}); retry shortly", "server_overloaded",
                                          "too_many_connections"))
                transport.close()
                shared.note("refused", len(self.connections))
                return
        self._set_idle(True)
        self._arm(self.limits.header_timeout_s, self._header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._held is not None or not self._in_request():
            data = self._hold(data)
            if data is None:
                return
        self._pass_on(data)

    def _hold(self, data: bytes) -> bytes | None:
        """Keep a next request's bytes until its headers and (up to hold_body_bytes) body are complete; -> the
        bytes to hand on now, or None while held. A held body's reads are timed by the body timeout."""
        if self._held is None:
            self._held, self._held_t, self._held_need = bytearray(), time.perf_counter(), -1
        buf = self._held
        start = max(0, len(buf) - 3)             # a header end may straddle the previous read
        buf += data
        if self._held_need < 0:
            end = buf.find(b"\r\n\r\n", start)
            if end < 0:
                if len(buf) <= self.limits.max_header_bytes:
                    self._got_bytes = True       # the header timeout answers 408, not silence
                    return None
                return self._release()           # h11 refuses the headers
            length = held_body_length(bytes(buf[:end]))
            if length is None or length > self.limits.hold_body_bytes:
                return self._release()
            self._held_need = end + 4 + length
            self._set_idle(False)                # a request in progress: never shed as idle
        if len(buf) >= self._held_need:
            return self._release()
        self._arm(self.limits.body_timeout_s, self._held_body_timeout)
        return None

    def _release(self) -> bytes:
        data, self._held = bytes(self._held), None
        if self._kvscope_t is None:              # a kept-alive connection's request arrived with its first byte
            self._kvscope_t = self._held_t
        return data

    def _held_body_timeout(self) -> None:
        """A held body stalled: hand what came to the app as it is, so that the request is answered 408 and
        counted as any body timeout is."""
        self._timer = None
        if self._held is None or self.transport.is_closing():
            return
        self._pass_on(self._release())
        if self._in_request():
            self._body_timeout()
        else:
            self._close_quietly()

    def _pass_on(self, data: bytes) -> None:
        was_in_request = self._in_request()
        super().data_received(data)
        if self.transport.is_closing():
            return
        if not self._in_request():
            self._got_bytes = True
            if was_in_request:                   # the response went out meanwhile: a fresh header deadline
                self._arm(None, None)
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._half_closed:
            self.transport.close()
            return
        self._arm(None, None)
        self._got_bytes = False
        self._update()

    def eof_received(self):
        # A complete HTTP/1.1 request whose client closed its sending side still gets its response. A half-close
        # and a full close look the same from here, so until the response starts, an interim `102 Processing`
        # (which clients skip) goes out once: a client that closed fully answers it with a reset, which the
        # socket's pending error shows (checked with back-off), and the request is aborted as for any disconnect.
        if self._in_request() and not self.cycle.more_body and self.scope.get("http_version") == "1.1":
            self._half_closed = True
            self.cycle.keep_alive = False
            self.transport.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            self._probe_timer = self.loop.call_later(PROBE_FIRST_S, self._probe, PROBE_FIRST_S)
            return True
        return None                                # asyncio closes the transport: a disconnect

    def _probe(self, delay: float) -> None:
        """Has the peer reset the connection since the 102 probe? Then it closed fully: a disconnect."""
        self._probe_timer = None
        if self.transport.is_closing() or not self._in_request():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()                 # connection_lost: the request is aborted
            return
        if self.cycle.response_started and delay >= PROBE_S:
            return                                 # a started response's own writes will meet the reset
        delay = min(2 * delay, PROBE_S)
        self._probe_timer = self.loop.call_later(delay, self._probe, delay)

    def connection_lost(self, exc) -> None:
        if self._held is not None and self._held_need >= 0:
            super().data_received(self._release())   # an abandoned upload: the app sees it go (499)
        self._set_idle(False)
        self._arm(None, None)
        if self._probe_timer is not None:
            self._probe_timer.cancel()
        super().connection_lost(exc)

    # ---- timeouts and errors ------------------------------------------------------------------------
    def _close_quietly(self) -> None:
        self._set_idle(False)
        self._arm(None, None)
        if not self.transport.is_closing():
            self.transport.close()

    def _header_timeout(self) -> None:
        self._timer = None
        if self._in_request() or self.transport.is_closing():
            return
        if self._got_bytes:
            self.transport.write(raw_error(408, f"request headers not received within {self.limits.header_timeout_s:g}"
                                                " s (server header timeout)", "timeout_error", "header_timeout"))
        self._close_quietly()

    def _body_timeout(self) -> None:
        self._timer = None
        if not self._in_request() or self.transport.is_closing():
            return
        state = self.cycle.scope.setdefault("state", {})
        state["kvscope_status"] = 408
        if not self.cycle.response_started:
            self.transport.write(raw_error(408, f"request body not received: no bytes for "
                                                f"{self.limits.body_timeout_s:g} s (server body timeout)",
                                           "timeout_error", "body_timeout"))
        self._close_quietly()

    def send_400_response(self, msg: str) -> None:
        e = self._protocol_error
        status = getattr(e, "error_status_hint", 400) if e is not None else 400
        if status == 431:
            message = f"request headers too large (at most {self.limits.max_header_bytes} bytes)"
            code = "headers_too_large"
        else:
            status = 400
            message = f"malformed HTTP request: {e}" if e is not None and str(e) else f"malformed HTTP request: {msg}"
            code = "invalid_http"
        self.transport.write(raw_error(status, message, "invalid_request_error", code))
        self._close_quietly()


def guarded_protocol(limits: HttpLimits) -> type[GuardedProtocol]:
    """uvicorn's `http=` protocol class with these limits."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits})
