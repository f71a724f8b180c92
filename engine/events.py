"""The engine's event stream: the inspector's contract.

Two kinds of records, both plain dataclasses (cheap, picklable, JSON-able via `to_dict`):

- `StepEvent`: one per engine step, emitted after the step's outputs are processed.
- `RequestEvent`: one per request lifecycle change (arrived, scheduled, first_token, preempted,
  finished, aborted, rejected, failed).
- `StepFailureEvent`: an engine step raised; the requests that made it raise were failed, the others ran on.

Each record carries the `engine_index` of the data-parallel replica that emitted it (0 for a single engine).
All times are `time.perf_counter()` seconds (the same clock as `RequestMetrics`). Listeners are called
synchronously on the engine thread: they must be quick (append to a buffer) and must not raise; an
exception in a listener is caught and logged, never propagated into the engine. With no listener,
`EventBus.active` is False and the engine skips building records altogether.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

log = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request_id: str
    num_tokens: int                  # tokens computed for this request in this step
    phase: str                       # "prefill" (a prompt chunk or recompute) | "decode"
    num_computed_before: int         # computed tokens before this step
    total_len: int                   # prompt + generated tokens known before this step
    num_spec_tokens: int = 0         # draft tokens verified in this step (speculative decoding)


@dataclass
class StepEvent:
    step: int
    start: float
    end: float
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int                 # after the step
    num_waiting: int                 # after the step
    blocks_allocated: list[int]      # physical block ids newly taken in this step
    blocks_freed: list[int]          # physical block ids returned (ref count hit zero)
    blocks_evicted: list[int]        # cached blocks whose hash was dropped to be reused
    blocks_shared: int               # blocks reused from the prefix cache by admissions this step
    preempted: list[str]             # request ids preempted in this step
    finished: list[str]              # request ids finished in this step
    kv_usage: float                  # fraction of blocks in use after the step (0..1)
    num_blocks: int
    prefix_cache_queries: int = 0    # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0       # of which were found cached
    timings: dict[str, float] = field(default_factory=dict)  # seconds per region: schedule, prepare,
    #   embedding, attention, mlp, norms, lm_head, sampling, forward (whole model), postprocess
    cuda_graph: bool = False         # decode step replayed from a captured CUDA graph
    num_decode_steps: int = 1        # > 1: a multi-step decode (each request computed this many tokens)
    block_plan: dict | None = None   # a decode block under multi_step_max_ms: why it runs num_decode_steps iterations:
    #   iteration_ms (estimated time per iteration), budget_iterations (what the budget allows), host_round_ms
    #   (the host's work between blocks; None where blocks run synchronously), cover_iterations (what hides it;
    #   None while newcomers wait)
    spec: dict | None = None         # {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
    #                                   "accepted_per_pos": list[int]} when speculative decoding ran
    memory: dict | None = None       # bytes after the step: allocated, max_allocated, kv_pool, kv_reserved,
    #                                   kv_used; and reserved_slots, used_slots (LLMEngine.memory_stats)
    timings_sampled: bool = False    # a graph-eligible step run eagerly to time it (graph_timing_interval)
    rank_timings: dict[int, dict[str, float]] | None = None   # tensor parallelism: the other ranks' forward
    #                                   regions (seconds, incl. all_reduce), by rank; rank 0's are in timings
    swapped_out: list[str] = field(default_factory=list)   # preempted by swapping to the host tier (in `preempted`)
    swapped_in: list[str] = field(default_factory=list)    # admitted with their blocks copied back from it
    blocks_offloaded: int = 0        # evicted cached blocks kept in the host tier's LRU this step
    blocks_fetched: int = 0          # prefix-cache blocks copied back from the host tier this step
    bytes_swapped_out: int = 0       # device -> host bytes this step (swaps and offloads)
    bytes_swapped_in: int = 0        # host -> device bytes this step
    engine_index: int = 0            # the data-parallel replica that ran the step
    kind: str = "step"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestEvent:
    kind: str                        # "arrived" | "scheduled" | "first_token" | "preempted" | "swapped_out" |
    #                                  "swapped_in" | "finished" | "aborted" | "rejected" | "failed"
    request_id: str
    time: float
    step: int                        # engine step index at the event (-1 before any step)
    prompt_len: int = 0
    output_len: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    block_table: list[int] | None = None  # on "scheduled"/"preempted"/"finished": the request's blocks
    message: str | None = None            # on "rejected" / "failed": why
    arrival_time: float | None = None     # on "arrived": when the front end received the request (`time` is
    #                                       when the engine took it into its waiting queue)
    priority: int | None = None           # SamplingParams.priority (lower = sooner under the priority policy)
    structured: str | None = None         # on "arrived": the output constraint's kind (json, regex, choice, grammar,
    #                                       json_object), None for an unconstrained request
    engine_index: int = 0                 # the data-parallel replica that holds the request

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepFailureEvent:
    """A step whose prepare / forward / sampling raised. The engine re-ran its batch in halves until the
    requests that raise were alone, failed those (a "failed" RequestEvent each) and kept the others."""
    step: int                        # engine step index when it failed
    time: float
    error: str                       # the first exception, "Type: message"
    failed: list[str]                # request ids failed because their rows raised
    num_requests: int                # requests in the failed step
    num_retries: int                 # sub-steps run to isolate them
    engine_index: int = 0            # the data-parallel replica whose step failed
    kind: str = "step_failure"

    def to_dict(self) -> dict:
        return asdict(self)


Listener = Callable[[object], None]


class EventBus:
    """A tiny synchronous publish/subscribe bus."""

    def __init__(self):
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self._listeners)

    def subscribe(self, fn: Listener) -> Callable[[], None]:
        with self._lock:
            self._listeners = self._listeners + [fn]

        def unsubscribe():
            with self._lock:
                self._listeners = [f for f in self._listeners if f is not fn]
        return unsubscribe

    def emit(self, event) -> None:
        for fn in self._listeners:
            try:
                fn(event)
            except Exception:  # a broken listener never takes the engine down
                log.exception("event listener %r failed", fn)
