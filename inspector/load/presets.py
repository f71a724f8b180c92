"""Workload presets (steady, overload, burst, long prompts, short chats, memory pressure, shared prefix,
multi-turn), sized from the engine's limits and, when `EngineInfo.capacity` was measured, its speed: steady
presets arrive at a fixed fraction of the rate the engine sustains for their mix (capacity.py), the overload
preset above it, so each shows what its name says on a 2-core CPU and on an H200 alike. Without a measurement
the rates are fixed (a GPU-sized guess)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from inspector.load.capacity import Capacity
from inspector.load.spec import LengthDist, LoadSpec

STEADY_LOAD = 0.55          # steady presets: this fraction of the measured capacity
OVERLOAD = 3.0              # the overload preset: this multiple of it (the fit underrates big batches)
ARRIVAL_SPAN_S = 30.0       # calibrated presets send about this many seconds of arrivals
MIN_REQUESTS, MAX_REQUESTS_PRESET = 8, 512


@dataclass
class EngineInfo:
    num_blocks: int = 512
    block_size: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    vocab_size: int = 32000
    chat_template: bool = True          # text prompts (prompt_source="text") need one
    num_replicas: int = 1               # data-parallel replicas, each with the limits above
    capacity: Capacity | None = None

    @classmethod
    def from_loop(cls, loop, capacity: Capacity | None = None) -> "EngineInfo":
        eng = loop.engine
        cfg = eng.config
        mml = getattr(eng, "max_model_len", None) or cfg.model_config.max_model_len or 2048
        tok = getattr(eng, "tokenizer", None)
        vocab = getattr(tok, "vocab_size", None) or 32000
        mv = getattr(getattr(eng, "arch_config", None), "vocab_size", None)
        if mv:
            vocab = min(vocab, mv)
        return cls(num_blocks=int(getattr(eng, "num_blocks", 512)),
                   block_size=int(getattr(eng, "block_size", cfg.cache_config.block_size)),
                   max_model_len=int(mml), max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                   max_num_seqs=cfg.scheduler_config.max_num_seqs,
                   enable_chunked_prefill=cfg.scheduler_config.enable_chunked_prefill,
                   vocab_size=int(vocab), chat_template=bool(getattr(tok, "chat_template", None)),
                   num_replicas=loop.config.parallel_config.data_parallel_size, capacity=capacity)


def _fit(d: LengthDist, cap: int) -> LengthDist:
    cap = max(1, int(cap))
    return LengthDist(d.kind, max(1, min(d.low, cap)), max(1, min(d.high, cap)))


def _mean(d: LengthDist) -> float:
    return float(d.low) if d.kind == "fixed" else (d.low + d.high) / 2


def _sig(x: float) -> float:
    """x to 2 significant digits (a rate a person can read and type)."""
    return float(f"{x:.2g}")


def _calibrated(spec: LoadSpec, info: EngineInfo, load: float,
                prompt_tokens: Callable[[LoadSpec], float] | None = None, per_user: int = 1,
                min_requests: int = MIN_REQUESTS) -> LoadSpec:
    """Set spec.rate to `load` x the measured capacity for its mix (prompt_tokens: the prompt tokens each
    request computes, default the mean new prompt; per_user: requests per simulated user) and size
    num_requests to about ARRIVAL_SPAN_S of arrivals. Unchanged when nothing was measured."""
    cap = info.capacity
    if cap is None:
        return spec
    spec = _fit_limits(spec, info)           # size the rate for the lengths that will run
    p = _mean(spec.prompt_len) if prompt_tokens is None else prompt_tokens(spec)
    o = _mean(spec.output_len)
    sustained = cap.req_per_s(p, o)
    rate = _sig(load * sustained / per_user)
    users = max(min_requests // per_user, min(MAX_REQUESTS_PRESET // per_user, round(rate * ARRIVAL_SPAN_S)))
    spec.rate, spec.num_requests = rate, users * per_user
    what = "users/s" if per_user > 1 else "req/s"
    spec.description += (f" **Calibrated: {rate:g} {what}** = {load:.0%} of the ≈{sustained / per_user:.3g} {what} this "
                         f"engine sustains for this mix ({cap.describe(p, o)}).")
    return spec


def _steady(info: EngineInfo) -> LoadSpec:
    spec = LoadSpec("Steady Poisson", 32, 4.0, 1.0, None, LengthDist("uniform", 64, 256), LengthDist("uniform", 32, 128),
                    description="Poisson arrivals (burstiness 1) at a steady rate the engine keeps up with: the "
                                "everyday serving case; the waiting queue stays short.")
    return _calibrated(spec, info, STEADY_LOAD)


def _overload(info: EngineInfo) -> LoadSpec:
    spec = LoadSpec("Overload", 64, 16.0, 1.0, None, LengthDist("uniform", 64, 256), LengthDist("uniform", 32, 128),
                    description="The steady mix arriving faster than the engine can serve it: the waiting queue and "
                                "TTFT grow for as long as arrivals last.")
    return _calibrated(spec, info, OVERLOAD, min_requests=32)


def _burst(info: EngineInfo) -> LoadSpec:
    return LoadSpec("One burst", 32, math.inf, 1.0, None, LengthDist("uniform", 64, 256), LengthDist("uniform", 32, 128),
                    description="Every request arrives at once: watch the waiting queue drain and the batch fill.")


def _long(info: EngineInfo) -> LoadSpec:
    out = LengthDist("uniform", 16, 32)
    budget = info.max_num_batched_tokens
    hi = int(budget * 1.5) if info.enable_chunked_prefill else budget
    hi = max(2, min(hi, info.max_model_len - out.high - 1))
    lo = max(1, min(int(budget * 0.75), hi))
    spec = LoadSpec("Long prompts (chunked prefill)", 6, 0.5, 1.0, None, LengthDist("uniform", lo, hi), out,
                    description=f"Prompts of {lo}–{hi} tokens against a {budget}-token step budget: prefills are "
                                "split into chunks that share steps with other requests' decodes.")
    return _calibrated(spec, info, STEADY_LOAD)


def _short_chats(info: EngineInfo) -> LoadSpec:
    spec = LoadSpec("Many short chats", 96, 24.0, 0.5, 48, LengthDist("uniform", 16, 64), LengthDist("uniform", 8, 48),
                    description="Many users with short prompts and replies, bursty arrivals (k = 0.5), at most 48 in flight.")
    return _calibrated(spec, info, STEADY_LOAD)


def _memory_pressure(info: EngineInfo) -> LoadSpec:
    capacity = info.num_blocks * info.block_size          # tokens the KV pool can hold
    conc = max(2, min(16, info.max_num_seqs))
    per = min(math.ceil(1.6 * capacity / conc), info.max_model_len - 1)
    if per * conc < 1.3 * capacity:
        conc = max(2, min(info.max_num_seqs, math.ceil(1.6 * capacity / max(per, 1))))
    prompt = max(1, per // 4)
    output = max(1, per - prompt)
    n = (conc + conc // 2) * info.num_replicas          # the router spreads them: each replica gets its share
    pool = f"a pool of {capacity} tokens ({info.num_blocks} blocks × {info.block_size})"
    if info.num_replicas > 1:
        pool = (f"{info.num_replicas} replicas' pools of {capacity} tokens ({info.num_blocks} blocks × "
                f"{info.block_size}) each")
    return LoadSpec("Memory pressure (preemption)", n, math.inf, 1.0, None,
                    LengthDist("uniform", max(1, int(prompt * 0.9)), prompt), LengthDist("uniform", max(1, int(output * 0.9)), output),
                    description=f"{n} requests of up to {per} tokens each against {pool}: decodes outgrow the pool "
                                "and the scheduler preempts. On a CPU, lower num_kv_blocks in Engine settings for a "
                                "quick demo.")


def _shared_prefix(info: EngineInfo) -> LoadSpec:
    prefix = max(4 * info.block_size, 256)
    prefix = min(prefix, max(0, info.max_model_len - 64 - 64 - 1))
    spec = LoadSpec("Shared system prompt (prefix caching)", 32, 8.0, 1.0, None, LengthDist("uniform", 16, 64),
                    LengthDist("uniform", 16, 64), shared_prefix_len=prefix, prompt_source="text",
                    description=f"Every request starts with the same {prefix}-token system prompt: with prefix caching "
                                "its blocks are computed once and shared (see the block map and the cache hit rate). "
                                "Prompts are chat-templated text from the bundled set.")
    # sized as if the prefix were computed every time, so the load stays steady with prefix caching off too
    return _calibrated(spec, info, STEADY_LOAD, prompt_tokens=lambda sp: prefix + _mean(sp.prompt_len))


def _multi_turn(info: EngineInfo) -> LoadSpec:
    turns = 4
    spec = LoadSpec("Multi-turn chat", 32, 2.0, 1.0, None, LengthDist("uniform", 16, 64), LengthDist("uniform", 16, 48),
                    num_turns=turns, think_time_s=0.2, prompt_source="text",
                    description=f"Users × {turns} turns of chat-templated text: each turn resends the whole conversation, so earlier turns "
                                "hit the prefix cache.")
    # a turn's prompt averages half the conversation so far; sized as if none of it were cached
    def prompt_tokens(sp: LoadSpec) -> float:
        return _mean(sp.prompt_len) + (turns - 1) / 2 * (_mean(sp.prompt_len) + _mean(sp.output_len))
    return _calibrated(spec, info, STEADY_LOAD, prompt_tokens=prompt_tokens, per_user=turns)


def _real_text(info: EngineInfo) -> LoadSpec:
    spec = LoadSpec("Real text (speculative decoding)", 24, 4.0, 1.0, None, LengthDist("uniform", 64, 256),
                    LengthDist("uniform", 64, 128), prompt_source="text",
                    description="Chat-templated prompts from the bundled text set (summarize, rewrite, repeat, answer): "
                                "with speculative decoding on, the acceptance rate is that of text, where n-gram drafts "
                                "find the prompt's phrases again; random ids would give them nothing to match.")
    return _calibrated(spec, info, STEADY_LOAD)


PRESETS: dict[str, Callable[[EngineInfo], LoadSpec]] = {
    "Steady Poisson": _steady,
    "Overload": _overload,
    "One burst": _burst,
    "Long prompts (chunked prefill)": _long,
    "Many short chats": _short_chats,
    "Memory pressure (preemption)": _memory_pressure,
    "Shared system prompt (prefix caching)": _shared_prefix,
    "Multi-turn chat": _multi_turn,
    "Real text (speculative decoding)": _real_text,
}


def _fit_limits(spec: LoadSpec, info: EngineInfo) -> LoadSpec:
    """Shrink the lengths so every request (and every turn's conversation) fits max_model_len."""
    room = info.max_model_len - 1 - spec.shared_prefix_len
    per_turn = max(2, room // max(1, spec.num_turns))
    if spec.prompt_len.max + spec.output_len.max > per_turn:
        out_cap = max(1, min(spec.output_len.max, per_turn // 2))
        spec.output_len = _fit(spec.output_len, out_cap)
        spec.prompt_len = _fit(spec.prompt_len, per_turn - spec.output_len.max)
    return spec


def preset(name: str, info: EngineInfo | None = None, **overrides) -> LoadSpec:
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; choose one of {list(PRESETS)}")
    info = info or EngineInfo()
    spec = _fit_limits(PRESETS[name](info), info)
    if spec.prompt_source == "text" and not info.chat_template:
        spec.prompt_source = "random ids"
    return replace(spec, **overrides) if overrides else spec
