"""Per-request tracks: engine events, folded in order, into timeline spans, totals and spec-decoding counters.

Timeline spans per request (phase, start, end) in both seconds and engine-step coordinates:
  frontend   arrival at the front end (server, load runner, playground) -> the engine's waiting queue
             (tokenization and the hand-over to the engine thread: a front-end bottleneck shows here)
  waiting    the engine's waiting queue -> first scheduled step
  prefill    consecutive steps that computed prompt tokens (chunked prefill shows as several spans,
             recompute after a preemption shows as prefill again)
  decode     consecutive decode steps
  preempted  preemption -> next scheduled step (recompute)
  swapped    preemption by swapping to the host KV tier -> swapped in (its first span after notes the bytes back)
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine.events import RequestEvent, StepEvent

PHASES = ("frontend", "waiting", "prefill", "decode", "preempted", "swapped")
_TERMINAL = ("finished", "aborted", "rejected", "failed")


@dataclass
class Span:
    phase: str
    start: float          # perf_counter seconds
    end: float
    step_start: float     # engine-step coordinates: step k occupies [k, k+1)
    step_end: float
    num_tokens: int = 0   # tokens computed in this span (prefill/decode)
    note: str = ""        # "recompute" / "resumed from prefix cache" for the first span after a preemption


@dataclass
class RequestTrack:
    request_id: str
    arrival: float | None = None
    arrival_step: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    num_cached_tokens: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    status: str = "waiting"   # waiting | running | preempted | finished | aborted | rejected | failed
    num_preemptions: int = 0
    num_swaps: int = 0
    message: str | None = None
    priority: int | None = None   # SamplingParams.priority (lower = sooner under the priority policy)
    structured: str | None = None  # the output constraint's kind (json, regex, choice, ...), None = unconstrained
    engine_index: int = 0         # the data-parallel replica that holds it
    block_table: list[int] | None = None
    spans: list[Span] = field(default_factory=list)
    # open span bookkeeping
    _open: Span | None = None
    _last_step: int = -10
    _pending_since: tuple[float, float] | None = None   # (time, step coord) of waiting/preempted start
    _pending_phase: str = "waiting"
    _last_pending: str = "waiting"      # the pending phase that the latest scheduled step closed

    def copy(self, now: float, now_step: float) -> "RequestTrack":
        """A detached copy whose open spans are closed at `now` (for display)."""
        spans = list(self.spans)
        if self._open is not None:
            o = self._open
            spans.append(Span(o.phase, o.start, o.end, o.step_start, o.step_end, o.num_tokens, o.note))
        if self._pending_since is not None and self.status in ("waiting", "preempted"):
            t, s = self._pending_since
            spans.append(Span(self._pending_phase, t, max(now, t), s, max(now_step, s)))
        spans.sort(key=lambda sp: sp.start)
        return RequestTrack(
            request_id=self.request_id, arrival=self.arrival, arrival_step=self.arrival_step,
            prompt_len=self.prompt_len, output_len=self.output_len, num_cached_tokens=self.num_cached_tokens,
            first_scheduled=self.first_scheduled, first_token=self.first_token, finished=self.finished,
            finish_reason=self.finish_reason, status=self.status, num_preemptions=self.num_preemptions,
            message=self.message, block_table=list(self.block_table) if self.block_table else None,
            spans=spans, priority=self.priority, structured=self.structured, engine_index=self.engine_index)


class TrackBuilder:
    """Folds events, in order, into `tracks` (the most recent `max_requests`), `totals` and `spec`. Not
    thread-safe: the Recorder calls it under its processing lock. Each data-parallel replica counts its own steps,
    so step coordinates are kept per engine_index."""

    def __init__(self, max_requests: int, max_steps: int):
        self.max_requests = max_requests
        self.tracks: "OrderedDict[str, RequestTrack]" = OrderedDict()
        self.t0: float | None = None
        self.last_step: dict[int, int] = {}     # engine_index -> its latest step
        self.last_step_end: float | None = None
        self.num_engines = 1                    # 1 + the highest engine_index seen
        self.totals = dict(steps=0, prompt_tokens=0, decode_tokens=0, output_tokens=0, preemptions=0,
                           finished=0, aborted=0, rejected=0, failed=0, step_failures=0, arrived=0, prefix_cache_queries=0,
                           prefix_cache_hits=0, blocks_shared=0, blocks_evicted=0, busy_time=0.0,
                           swaps=0, bytes_swapped_out=0, bytes_swapped_in=0)
        self.spec = dict(num_steps=0, num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                         accepted_per_pos=[], history=deque(maxlen=max_steps))

    def track(self, rid: str) -> RequestTrack:
        tr = self.tracks.get(rid)
        if tr is None:
            tr = RequestTrack(request_id=rid)
            self.tracks[rid] = tr
            while len(self.tracks) > self.max_requests:
                self.tracks.popitem(last=False)
        return tr

    def step_coord(self, engine_index: int = 0) -> float:
        return float(self.last_step.get(engine_index, -1) + 1)

    def _close_open(self, tr: RequestTrack) -> None:
        if tr._open is not None:
            tr.spans.append(tr._open)
            tr._open = None
            if len(tr.spans) > 256:           # a very long request: keep its latest spans
                del tr.spans[:len(tr.spans) - 256]

    def on_request(self, ev: RequestEvent) -> None:
        if self.t0 is None:
            self.t0 = ev.time
        tr = self.track(ev.request_id)
        k = ev.kind
        tr.engine_index = ev.engine_index
        self.num_engines = max(self.num_engines, ev.engine_index + 1)
        if ev.prompt_len:
            tr.prompt_len = ev.prompt_len
        if ev.output_len:
            tr.output_len = max(tr.output_len, ev.output_len)
        if ev.num_cached_tokens:
            tr.num_cached_tokens = ev.num_cached_tokens
        if ev.block_table is not None:
            tr.block_table = list(ev.block_table)
        if getattr(ev, "priority", None) is not None:
            tr.priority = ev.priority
        if getattr(ev, "structured", None) is not None:
            tr.structured = ev.structured
        if k == "arrived":
            self.totals["arrived"] += 1
            tr.arrival_step = self.step_coord(ev.engine_index)
            tr.arrival = ev.time
            if ev.arrival_time is not None and ev.arrival_time < ev.time:
                tr.arrival = ev.arrival_time
                tr.spans.append(Span("frontend", ev.arrival_time, ev.time, tr.arrival_step, tr.arrival_step))
            tr.status = "waiting"
            tr._pending_since = (ev.time, tr.arrival_step)
            tr._pending_phase = "waiting"
        elif k == "scheduled":
            if tr.first_scheduled is None:
                tr.first_scheduled = ev.time
        elif k == "first_token":
            if tr.first_token is None:
                tr.first_token = ev.time
        elif k == "preempted":
            self._preempt(tr, ev.time, self.step_coord(ev.engine_index))
        elif k == "swapped_out":
            self._swap_out(tr)
        elif k in _TERMINAL:
            if tr.status not in _TERMINAL:
                self.totals[k] += 1
            self._finish(tr, ev.time, k, ev.finish_reason)
            if k in ("rejected", "failed"):
                tr.message = ev.message

    def _preempt(self, tr: RequestTrack, t: float, step_coord: float) -> None:
        if tr.status == "preempted":
            return
        self._close_open(tr)
        tr.status = "preempted"
        tr.num_preemptions += 1
        self.totals["preemptions"] += 1
        tr._pending_since = (t, step_coord)
        tr._pending_phase = "preempted"

    def _swap_out(self, tr: RequestTrack) -> None:
        """A preemption (already folded) whose blocks went to the host tier: its pending span is "swapped"."""
        if tr._pending_phase != "swapped":
            tr._pending_phase = "swapped"
            tr.num_swaps += 1
            self.totals["swaps"] += 1

    def _finish(self, tr: RequestTrack, t: float, status: str, reason: str | None) -> None:
        # the open span stays open: the finishing step's StepEvent may still arrive and extend it
        if tr._pending_since is not None and tr.status in ("waiting", "preempted"):
            ts, ss = tr._pending_since
            tr.spans.append(Span(tr._pending_phase, ts, max(t, ts), ss, max(self.step_coord(tr.engine_index), ss)))
        tr._pending_since = None
        tr._pending_phase = "waiting"
        tr.status = status
        tr.finished = t if tr.finished is None else tr.finished
        if reason:
            tr.finish_reason = reason

    def on_step(self, ev: StepEvent) -> None:
        if self.t0 is None:
            self.t0 = ev.start
        tot = self.totals
        tot["steps"] += 1
        tot["prompt_tokens"] += ev.num_prefill_tokens
        tot["decode_tokens"] += ev.num_decode_tokens
        tot["prefix_cache_queries"] += ev.prefix_cache_queries
        tot["prefix_cache_hits"] += ev.prefix_cache_hits
        tot["blocks_shared"] += ev.blocks_shared
        tot["blocks_evicted"] += len(ev.blocks_evicted)
        tot["busy_time"] += max(0.0, ev.end - ev.start)
        tot["bytes_swapped_out"] += getattr(ev, "bytes_swapped_out", 0)
        tot["bytes_swapped_in"] += getattr(ev, "bytes_swapped_in", 0)
        swapped_in = set(getattr(ev, "swapped_in", ()))
        tot["output_tokens"] += step_output_tokens(ev)
        s = ev.step
        self.num_engines = max(self.num_engines, ev.engine_index + 1)
        for sr in ev.scheduled:
            tr = self.track(sr.request_id)
            tr.engine_index = ev.engine_index
            if tr.arrival is None:             # arrived before we subscribed
                tr.arrival = ev.start
                tr.arrival_step = float(s)
            if tr.first_scheduled is None:
                tr.first_scheduled = ev.start
            tr._last_pending = tr._pending_phase
            if tr._pending_since is not None:
                ts, ss = tr._pending_since
                tr.spans.append(Span(tr._pending_phase, ts, max(ev.start, ts), ss, max(float(s), ss)))
                tr._pending_since = None
                tr._pending_phase = "waiting"
            was_preempted = tr.status == "preempted"
            was_swapped = was_preempted and tr._last_pending == "swapped"
            if tr.status not in _TERMINAL:
                tr.status = "running"
            o = tr._open
            if o is not None and o.phase == sr.phase and tr._last_step == s - 1:
                o.end = ev.end
                o.step_end = s + 1.0
                o.num_tokens += sr.num_tokens
            else:
                self._close_open(tr)
                note = ""
                if sr.request_id in swapped_in or was_swapped:
                    n_in = len(swapped_in) or 1
                    note = f"swapped in ({getattr(ev, 'bytes_swapped_in', 0) / n_in / 2**20:.2f} MiB back)"
                elif sr.phase == "prefill" and (was_preempted or (tr.num_preemptions and sr.num_computed_before == 0)):
                    note = "recompute"                 # what the prefix cache no longer held is recomputed
                elif was_preempted:
                    note = "resumed from prefix cache"  # its own blocks were still cached: nothing to redo
                tr._open = Span(sr.phase, ev.start, ev.end, float(s), s + 1.0, sr.num_tokens, note)
            tr._last_step = s
            if sr.phase == "decode" or sr.num_computed_before + sr.num_tokens >= sr.total_len:
                if tr.first_token is None:
                    tr.first_token = ev.end
                tr.output_len = max(tr.output_len, sr.total_len - tr.prompt_len + 1) if tr.prompt_len else tr.output_len
        self.last_step[ev.engine_index] = s
        self.last_step_end = ev.end if self.last_step_end is None else max(self.last_step_end, ev.end)
        for rid in ev.preempted:
            self._preempt(self.track(rid), ev.end, s + 1.0)
        for rid in getattr(ev, "swapped_out", ()):
            self._swap_out(self.track(rid))
        for rid in ev.finished:
            tr = self.track(rid)
            if tr.status not in _TERMINAL:
                tot["finished"] += 1
                self._finish(tr, ev.end, "finished", tr.finish_reason)
        if ev.spec:
            sp = self.spec
            sp["num_steps"] += 1
            sp["num_drafts"] += int(ev.spec.get("num_drafts", 0))
            sp["num_draft_tokens"] += int(ev.spec.get("num_draft_tokens", 0))
            sp["num_accepted_tokens"] += int(ev.spec.get("num_accepted_tokens", 0))
            per = list(ev.spec.get("accepted_per_pos", []) or [])
            acc = sp["accepted_per_pos"]
            if len(acc) < len(per):
                acc.extend([0] * (len(per) - len(acc)))
            for i, v in enumerate(per):
                acc[i] += int(v)
            # (step, end, drafts, draft tokens, accepted, decoding requests with drafting auto-off, decoding)
            sp["history"].append((s, ev.end, int(ev.spec.get("num_drafts", 0)),
                                  int(ev.spec.get("num_draft_tokens", 0)),
                                  int(ev.spec.get("num_accepted_tokens", 0)),
                                  int(ev.spec.get("num_off", 0) or 0), int(ev.spec.get("num_decoding", 0) or 0)))


def step_output_tokens(ev: StepEvent) -> int:
    """Output tokens produced by a step: one per sequence that completed its prompt or decoded, plus
    accepted speculative tokens."""
    n = 0
    for sr in ev.scheduled:
        if sr.phase == "decode" or sr.num_computed_before + sr.num_tokens >= sr.total_len:
            n += 1
    if ev.spec:
        n += int(ev.spec.get("num_accepted_tokens", 0))
    return n
