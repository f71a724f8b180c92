"""What every lesson shares: seeded engines on the chosen model and device, an offline run that keeps the
step events and request stamps, and the JSON-able result record the figures and benchmarks read."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import LLMEngine, SamplingParams
from engine.events import StepEvent


@dataclass
class Setup:
    """Where lessons run: the model (a folder, a preset such as "dummy:tiny", None = bundled SmolLM2), device,
    dtype and seed. `scale` picks the sweep sizes: "small" (CPU, tests) or "large" (a GPU); "auto" by device."""
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    scale: str = "auto"

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda") or (self.device == "auto" and torch.cuda.is_available())

    @property
    def large(self) -> bool:
        return self.scale == "large" or (self.scale == "auto" and self.cuda)

    def engine(self, **cfg) -> LLMEngine:
        """An engine for one arm of a lesson; KV pools are always sized explicitly (num_kv_blocks), so a lesson
        never claims the memory of an engine already serving on the same GPU."""
        return LLMEngine(model=self.model, device=self.device, dtype=self.dtype, seed=self.seed, **cfg)


@dataclass
class Run:
    outputs: dict                                   # request id -> final RequestOutput
    steps: list[StepEvent] = field(default_factory=list)
    wall: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs.values())

    def peak(self, key: str) -> int:
        return max((s.memory[key] for s in self.steps if s.memory), default=0)

    @property
    def max_running(self) -> int:
        return max((s.num_running for s in self.steps), default=0)


def random_prompts(n: int, lengths, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids; `lengths` is one int or (lo, hi) drawn uniformly (seeded)."""
    rng = np.random.default_rng(seed)
    lens = [lengths] * n if isinstance(lengths, int) else rng.integers(lengths[0], lengths[1] + 1, n).tolist()
    return [rng.integers(10, vocab, int(k)).tolist() for k in lens]


def kv_pool(num_seqs: int, max_len: int, block_size: int = 16) -> dict:
    """Engine settings for a KV pool that holds `num_seqs` requests of `max_len` tokens at once (plus the null
    block and one spare)."""
    return dict(num_kv_blocks=num_seqs * -(-max_len // block_size) + 2, block_size=block_size)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True)


def run(eng: LLMEngine, prompts: list, params, on_step=None) -> Run:
    """Submit every prompt at once and step until all finish; `params` is one SamplingParams or one per prompt.
    `on_step(eng, step_index)` may add requests between steps."""
    out = Run({})
    unsubscribe = eng.events.subscribe(lambda ev: out.steps.append(ev) if isinstance(ev, StepEvent) else None)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    try:
        t0 = time.perf_counter()
        for p, sp in zip(prompts, plist):
            eng.add_request(p, sp)
        i = 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out.outputs[o.request_id] = o
            if on_step is not None:
                on_step(eng, i)
            i += 1
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        out.wall = time.perf_counter() - t0
    finally:
        unsubscribe()
    return out


def device_label(eng: LLMEngine) -> str:
    if eng.device.type == "cuda":
        return torch.cuda.get_device_name(eng.device)
    return f"cpu ({torch.get_num_threads()} threads)"


def result(name: str, title: str, what: str, eng: LLMEngine, series: dict, summary: dict, **params) -> dict:
    """The record a lesson returns: plain JSON (figures, the UI and benchmarks/lessons.py read it)."""
    return dict(lesson=name, title=title, what=what, model=eng.model_name, device=device_label(eng),
                dtype=str(eng.dtype).replace("torch.", ""), params=params, series=series, summary=summary)


def close(*engines: LLMEngine) -> None:
    for e in engines:
        e.close()
