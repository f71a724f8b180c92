"""Recorder: listens to the engine's EventBus and keeps bounded, thread-safe history.

The listener runs on the engine thread, so it only appends `(seq, event)` to ring buffers under a lock.
All derivation (per-request spans for the timeline, totals: inspector/tracks.py) happens later, in
`snapshot()`, on whichever thread asks (the app's figure producer, a notebook cell), incrementally: each
snapshot only processes the events that arrived since the previous one.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from engine.events import RequestEvent, StepEvent, StepFailureEvent
from engine.outputs import RequestMetrics
from inspector.tracks import RequestTrack, TrackBuilder


@dataclass
class RequestRecord:
    """A finished request as metrics see it: its stamps plus token counts."""
    request_id: str
    prompt_len: int
    output_len: int
    finish_reason: str | None
    metrics: RequestMetrics
    server_arrival: float | None = None     # over HTTP: the server's arrival stamp (x-kvscope-arrival-time)

    @classmethod
    def from_output(cls, out: Any) -> "RequestRecord":
        return cls(request_id=str(out.request_id), prompt_len=len(out.prompt_token_ids or []),
                   output_len=len(out.token_ids or []), finish_reason=out.finish_reason,
                   metrics=out.metrics)


@dataclass
class Snapshot:
    """A consistent, detached view of what the recorder has seen. Safe to use from any thread."""
    version: int
    t0: float                               # time origin for plots (first event seen)
    now: float
    steps: list[StepEvent]                  # the most recent steps (bounded)
    requests: list[RequestTrack]            # the most recent requests, by arrival
    records: list[RequestRecord]            # finished requests with their RequestMetrics
    totals: dict[str, float]
    spec: dict[str, Any]                    # cumulative spec-decoding counters
    kv: dict | None = None                  # loop.kv_snapshot() taken with this snapshot, if any
    dropped_events: int = 0                 # events that fell out of the ring before being processed
    num_replicas: int = 1                   # data-parallel replicas (events and tracks carry their engine_index)

    @property
    def request_map(self) -> dict[str, RequestTrack]:
        return {r.request_id: r for r in self.requests}


def kv_replicas(kv: dict | None) -> list[dict]:
    """Each replica's KV snapshot, by engine_index: DPEngineLoop.kv_snapshot() lists them under "replicas", an
    EngineLoop's is the one."""
    if not kv:
        return []
    return list(kv["replicas"]) if "replicas" in kv else [kv]


def steps_by_replica(steps: list, num_replicas: int) -> list[list]:
    """Steps per data-parallel replica, by engine_index (one replica: all of them); each replica counts its own."""
    if num_replicas == 1:
        return [steps]
    return [[s for s in steps if s.engine_index == r] for r in range(num_replicas)]


class Recorder:
    """Subscribe with `rec.attach(*(e.events for e in loop.engines))`; read with `rec.snapshot()`."""

    def __init__(self, max_steps: int = 4096, max_requests: int = 2048, max_events: int = 65536):
        self.max_steps = max_steps
        self.max_requests = max_requests
        self._lock = threading.Lock()          # guards the ring buffers (held for an append only)
        self._proc_lock = threading.Lock()     # guards incremental processing in snapshot()
        self._events: deque = deque(maxlen=max_events)
        self._steps: deque = deque(maxlen=max_steps)
        self._records: "OrderedDict[str, RequestRecord]" = OrderedDict()
        self._seq = 0
        self._unsubscribe: list = []
        self._reset_derived()

    # ---------------------------------------------------------------- listening (engine thread)
    def __call__(self, event) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, event))
            if isinstance(event, StepEvent):
                self._steps.append(event)

    def attach(self, *buses) -> "Recorder":
        """Listen to each bus (a data-parallel replica's each; their events carry its engine_index)."""
        self.detach()
        self._unsubscribe = [bus.subscribe(self) for bus in buses]
        return self

    def detach(self) -> None:
        unsubscribe, self._unsubscribe = self._unsubscribe, []
        for fn in unsubscribe:
            fn()

    def record_output(self, out: Any) -> None:
        """Keep a finished request's stamps (a RequestOutput or a RequestRecord) for metrics."""
        rec = out if isinstance(out, RequestRecord) else RequestRecord.from_output(out)
        with self._lock:
            self._records[rec.request_id] = rec
            self._records.move_to_end(rec.request_id)
            while len(self._records) > self.max_requests * 2:
                self._records.popitem(last=False)
            self._seq += 1   # bump the version so producers notice

    def clear(self) -> None:
        with self._lock, self._proc_lock:
            self._events.clear()
            self._steps.clear()
            self._records.clear()
            self._seq += 1
            self._reset_derived()
            self._processed = self._seq

    @property
    def version(self) -> int:
        return self._seq

    # ---------------------------------------------------------------- derivation (any thread)
    def _reset_derived(self) -> None:
        self._tracks = TrackBuilder(self.max_requests, self.max_steps)
        self._processed = 0
        self._dropped = 0

    def _on_request(self, ev: RequestEvent) -> None:
        b = self._tracks
        b.on_request(ev)
        metrics = getattr(ev, "metrics", None)   # forward compatible: the engine may attach stamps
        if metrics is not None and ev.kind == "finished":
            rec = RequestRecord(ev.request_id, b.track(ev.request_id).prompt_len, ev.output_len, ev.finish_reason,
                                metrics)
            with self._lock:
                self._records.setdefault(ev.request_id, rec)

    def snapshot(self, kv: dict | None = None) -> Snapshot:
        with self._lock:
            version = self._seq
            events = list(self._events)
            steps = list(self._steps)
            records = list(self._records.values())
        with self._proc_lock:
            b = self._tracks
            if events and events[0][0] > self._processed + 1:
                self._dropped += events[0][0] - self._processed - 1
            for seq, ev in events:
                if seq <= self._processed:
                    continue
                try:
                    if isinstance(ev, StepEvent):
                        b.on_step(ev)
                    elif isinstance(ev, RequestEvent):
                        self._on_request(ev)
                    elif isinstance(ev, StepFailureEvent):
                        b.totals["step_failures"] += 1
                except Exception:  # a malformed event never breaks the inspector
                    import logging
                    logging.getLogger(__name__).exception("recorder could not process %r", ev)
                self._processed = seq
            if events:
                self._processed = max(self._processed, events[-1][0])
            now = time.perf_counter()
            if b.last_step_end is not None and not (b.last_step_end <= now <= b.last_step_end + 60.0):
                # events replayed from a recording, or a long-idle engine: open spans end at the last step
                now = b.last_step_end
            tracks = [tr.copy(now, b.step_coord(tr.engine_index)) for tr in b.tracks.values()]
            t0 = b.t0 if b.t0 is not None else now
            totals = dict(b.totals)
            spec = {k: (list(v) if isinstance(v, (list, deque)) else v) for k, v in b.spec.items()}
            dropped = self._dropped
            num_replicas = max(b.num_engines, len(self._unsubscribe))
        tracks.sort(key=lambda r: (r.arrival if r.arrival is not None else now))
        pools = kv_replicas(kv)
        for r, pool in enumerate(pools):
            if "num_cached_tokens" not in pool:     # for the block table: which blocks were hits
                pool["num_cached_tokens"] = {tr.request_id: tr.num_cached_tokens for tr in tracks
                                             if tr.num_cached_tokens and tr.engine_index == r}
        return Snapshot(version=version, t0=t0, now=now, steps=steps, requests=tracks, records=records,
                        totals=totals, spec=spec, kv=kv, dropped_events=dropped,
                        num_replicas=max(num_replicas, len(pools)))
