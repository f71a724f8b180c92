"""What a load is: token-length distributions (`LengthDist`) and the seeded `LoadSpec`, with validation that
names the offending knob."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

MAX_REQUESTS = 10_000
MAX_CONCURRENCY = 4096
MAX_RATE = 10_000.0


LENGTH_KINDS = ("fixed", "uniform", "normal", "lognormal")
PROMPT_SOURCES = ("random ids", "text")


@dataclass
class LengthDist:
    """Token lengths in [low, high]. fixed: always `low`; uniform: integers in [low, high];
    normal: mean (low+high)/2, std (high-low)/4, clipped; lognormal: median sqrt(low*high), long tail, clipped."""
    kind: str = "uniform"
    low: int = 32
    high: int = 128

    def validate(self, name: str) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"{name}: distribution must be one of {LENGTH_KINDS} (got {self.kind!r})")
        for v, what in ((self.low, "min"), (self.high, "max")):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"{name} {what}: must be a whole number of tokens (got {v!r})")
            if v < 1:
                raise ValueError(f"{name} {what}: must be >= 1 token (got {v})")
        if self.kind != "fixed" and self.high < self.low:
            raise ValueError(f"{name}: max ({self.high}) must be >= min ({self.low})")

    @property
    def max(self) -> int:
        return self.low if self.kind == "fixed" else self.high

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        lo, hi = int(self.low), int(max(self.high, self.low))
        if self.kind == "fixed" or lo == hi:
            return np.full(n, lo, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(lo, hi + 1, size=n)
        if self.kind == "normal":
            x = rng.normal((lo + hi) / 2, (hi - lo) / 4, size=n)
        else:  # lognormal
            x = rng.lognormal(math.log(math.sqrt(lo * hi)), max(1e-6, math.log(hi / lo) / 4), size=n)
        return np.clip(np.rint(x), lo, hi).astype(np.int64)


# ----------------------------------------------------------------------------- spec
@dataclass
class LoadSpec:
    name: str = "custom"
    num_requests: int = 32
    rate: float = 4.0                   # requests/s (users/s for multi-turn); inf = all at once
    burstiness: float = 1.0             # gamma shape k; 1 = Poisson
    max_concurrency: int | None = None  # None: unlimited
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 64, 256))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 32, 128))
    seed: int = 0
    shared_prefix_len: int = 0          # tokens of one system prompt shared by every request
    num_turns: int = 1                  # > 1: multi-turn chat; num_requests = users * turns
    think_time_s: float = 0.0           # pause between a reply and the user's next turn
    temperature: float = 0.0
    ignore_eos: bool = True
    description: str = ""
    prompt_source: str = "random ids"   # "text": chat prompts from the bundled text set (inspector.load.text), cut
    #                                     to the sampled lengths (random ids when the model has no chat template)

    @property
    def num_users(self) -> int:
        return max(1, math.ceil(self.num_requests / max(1, self.num_turns)))

    def max_total_len(self) -> int:
        """Longest prompt + output any request of this workload can have."""
        return self.shared_prefix_len + self.num_turns * (self.prompt_len.max + self.output_len.max)

    def validate(self, max_model_len: int | None = None) -> None:
        """Raise ValueError with a message naming the knob, for any input the runner cannot honour."""
        def bad(name, msg, v):
            raise ValueError(f"{name}: {msg} (got {v!r})")

        n = self.num_requests
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            bad("number of requests", "must be a whole number >= 1", n)
        if n > MAX_REQUESTS:
            bad("number of requests", f"too many simulated users; at most {MAX_REQUESTS}", n)
        if self.rate is None or not (self.rate > 0):
            bad("rate", "must be > 0 requests/s (use 'all at once' for a burst)", self.rate)
        if not math.isinf(self.rate) and self.rate > MAX_RATE:
            bad("rate", f"at most {MAX_RATE:g} requests/s (or 'all at once')", self.rate)
        if self.burstiness is None or not (0 < self.burstiness <= 100):
            bad("burstiness", "must be in (0, 100]; 1 = Poisson, < 1 burstier", self.burstiness)
        if self.max_concurrency is not None and not (1 <= self.max_concurrency <= MAX_CONCURRENCY):
            bad("max concurrency", f"must be empty/0 (unlimited) or in [1, {MAX_CONCURRENCY}]", self.max_concurrency)
        self.prompt_len.validate("prompt length")
        self.output_len.validate("output length")
        if self.seed is None or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            bad("seed", "must be a whole number >= 0", self.seed)
        if self.shared_prefix_len < 0:
            bad("shared prefix length", "must be >= 0", self.shared_prefix_len)
        if not (1 <= self.num_turns <= 64):
            bad("turns per user", "must be in [1, 64]", self.num_turns)
        if self.think_time_s < 0 or self.think_time_s > 600:
            bad("think time", "must be in [0, 600] s", self.think_time_s)
        if self.temperature < 0:
            bad("temperature", "must be >= 0", self.temperature)
        if self.prompt_source not in PROMPT_SOURCES:
            bad("prompts", f"must be one of {PROMPT_SOURCES}", self.prompt_source)
        if max_model_len is not None and self.max_total_len() > max_model_len:
            raise ValueError(
                f"lengths: the longest request would need {self.max_total_len()} tokens (shared prefix + "
                f"turns x (prompt max + output max)) but the engine's max_model_len is {max_model_len}; "
                "lower the maximum prompt/output lengths")

    def to_dict(self) -> dict:
        return asdict(self)
