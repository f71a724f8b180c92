"""What the engine hands back: per-request outputs and the timing stamps every metric is computed from."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Stamped once each (time.perf_counter() seconds): arrival where the request enters kvscope (the server,
    the load runner, the playground), the rest in the engine. Every TTFT/TPOT/ITL in kvscope comes from here."""
    arrival_time: float                      # the front end (server, load runner, playground) received it
    queued_time: float | None = None         # the engine took it into its waiting queue
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one stamp per emitted output (a step may add several tokens)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (at first admission)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Arrival -> first scheduled: the front end's wait and the engine's waiting queue together."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def frontend_time(self) -> float | None:
        """Arrival -> the engine's waiting queue (tokenization, hand-over to the engine thread)."""
        return None if self.queued_time is None else self.queued_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        """(E2E - TTFT) / (output tokens - 1): first token excluded."""
        if num_output_tokens < 2 or self.last_token_time is None or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class Logprob:
    token_id: int
    logprob: float
    decoded: str
    rank: int | None = None             # 1 = the most likely token (prompt logprobs)


@dataclass(slots=True, weakref_slot=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str                       # all generated text so far (stop string removed)
    token_ids: list[int]            # all generated token ids so far
    delta_text: str                 # text new since the previous output of this request
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort" | None
    metrics: RequestMetrics
    logprobs: list[list[Logprob]] | None = None  # per generated token: chosen first, then the top-n
    prompt_logprobs: list | None = None          # per prompt token (the first: None): its Logprob, then the top-n
    stop_reason: str | int | None = None          # the stop string or token id that ended it
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft

    @property
    def tpot(self) -> float | None:
        return self.metrics.tpot(len(self.token_ids))
