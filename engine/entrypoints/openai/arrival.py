"""Arrival stamps taken where a request's bytes reach the server, before uvicorn parses it.

In a burst, hundreds of requests reach the event loop together; a stamp taken in the ASGI app would
leave out the time each one waited for uvicorn to accept its connection and parse the requests ahead of
it. `ArrivalProtocol` (uvicorn's h11 HTTP protocol, which the connection guard in connection.py extends) stamps the first
request of a connection when the connection is accepted, and a later request on a kept-alive connection
when its first bytes are read; the stamp goes into the ASGI scope's `state["kvscope_arrival"]`, which
TTFT, queue time and E2E latency count from.

    uvicorn.run(app, http=ArrivalProtocol, ...)
"""
from __future__ import annotations

import time

from uvicorn.protocols.http.h11_impl import H11Protocol


class ArrivalProtocol(H11Protocol):
    def connection_made(self, transport) -> None:
        self._kvscope_t = time.perf_counter()     # the first request's arrival: the connection's
        self._kvscope_scope = None
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        super().data_received(data)
        scope = getattr(self, "scope", None)      # set by the parser once a request's headers are complete
        if scope is not None and scope is not self._kvscope_scope:
            self._kvscope_scope = scope
            scope.setdefault("state", {})["kvscope_arrival"] = min(t, self._kvscope_t) if self._kvscope_t else t
            self._kvscope_t = None                # later requests on this connection: their first bytes
