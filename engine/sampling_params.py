"""SamplingParams: how one request's tokens are chosen and when it stops (validated on construction)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
# What the sampler can compute in fp32 (logits are float32 whatever the model's dtype). A sampled row divides
# its logits by max(T, GREEDY_TEMPERATURE) (the fused kernel multiplies by 1 / T), and a repetition penalty
# multiplies or divides a logit by it before that: the bounds keep 1 / T a normal float32 and a penalized
# logit of magnitude up to 1e20 finite after the division (1e20 * 1e6 / 1e-5 = 1e31 < 3.4e38).
GREEDY_TEMPERATURE = 1e-5               # below: greedy (argmax)
MAX_TEMPERATURE = 1e30
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
INT64_MIN, UINT64_END = -2 ** 63, 2 ** 64


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    detokenize: bool = True             # False: outputs carry token ids and no text (no stop strings then)
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
        """Every field against what the sampler can compute: finite, representable, in range. The error names
        the field and the limit ("SamplingParams.<field>: ..."), so the API server answers a 400 naming it."""
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"SamplingParams.{name}: {msg} (got {getattr(self, name)!r})")

        def real(name: str, lo: float, hi: float, lo_open: bool = False):
            v = getattr(self, name)
            need(_is_real(v), name, "must be a finite number")
            need((lo < v if lo_open else lo <= v) and v <= hi, name,
                 f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]")

        real("temperature", 0, MAX_TEMPERATURE)
        real("top_p", 0, 1, lo_open=True)
        need(_is_int(self.top_k) and 0 <= self.top_k < 2 ** 63, "top_k",
             "must be -1, 0 (off) or a positive int below 2**63")
        real("min_p", 0, 1)
        real("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        real("presence_penalty", -2, 2)
        real("frequency_penalty", -2, 2)
        need(_is_int(self.max_tokens) and 1 <= self.max_tokens < 2 ** 63, "max_tokens",
             "must be an int in [1, 2**63)")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens", "must be an int in [0, max_tokens]")
        need(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed < UINT64_END), "seed",
             "must be None or an int in [-2**63, 2**64)")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             "logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(isinstance(self.detokenize, bool), "detokenize", "must be a bool")
        need(self.detokenize or not self.stop, "detokenize", "must be True for stop strings (they match text)")
        need(all(_is_int(t) and 0 <= t < 2 ** 63 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative ints (token ids)")
        need(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and isinstance(b, (int, float)) and not isinstance(b, bool)
            and -100 <= b <= 100 for t, b in self.logit_bias.items())), "logit_bias",
             "must map token ids (ints >= 0) to biases in [-100, 100]")
        need(_is_int(self.priority) and INT64_MIN <= self.priority < 2 ** 63, "priority",
             "must be an int in [-2**63, 2**63) (lower = scheduled sooner)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        """Logits processed on the host's terms before sampling: penalties, and logit_bias applied with them."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))
