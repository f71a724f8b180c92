"""SamplingParams: how one request's tokens are chosen and when it stops (validated on construction)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None         # top-n logprobs per generated token (0 = only the chosen token's)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token, from the prefill (no prefix-cache hit)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0                   # EngineConfig.scheduling_policy="priority": lower is scheduled sooner
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100] (OpenAI's)
    # constrain the output to a JSON schema / regex / choice / grammar (a dict of the same fields works too);
    # the grammar decides when it ends, so min_tokens does not ban EOS for these requests
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"SamplingParams.{name}: {msg} (got {getattr(self, name)!r})")

        need(self.temperature >= 0, "temperature", "must be >= 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 (off) or a positive int")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens", "must be an int in [0, max_tokens]")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be None or an int")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             "logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative ints")
        need(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
            and -100 <= b <= 100 for t, b in self.logit_bias.items())), "logit_bias",
             "must map token ids (ints >= 0) to biases in [-100, 100]")
        need(isinstance(self.priority, int) and not isinstance(self.priority, bool)
             and -2 ** 63 <= self.priority < 2 ** 63, "priority", "must be an int (lower = scheduled sooner)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        """Logits processed on the host's terms before sampling: penalties, and logit_bias applied with them."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))
