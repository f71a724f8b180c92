"""What the current engine sustains, measured in a few seconds through its public API, so presets can be sized
from it (`Capacity`, `measure_capacity`).

Cost model (the engine's own stamps, RequestMetrics): a decode step over b sequences takes a + c_d * b seconds
(the time per output token, TPOT, of b requests decoding together), and a prompt token costs c_p seconds
(prefill-only requests). At a steady rate of λ requests/s with mean prompt P and output O tokens, the engine
is busy λ·(O·(a/b + c_d) + P·c_p) of each second; with the largest batch the pool allows it is saturated at

    λ_max = 1 / (O·(a/b_max + c_d) + P·c_p),    b_max = min(max_num_seqs, KV tokens / (P + O)).

Presets run their steady loads at a fraction of λ_max and the overload preset above it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Capacity:
    prefill_s_per_token: float     # c_p
    step_s: float                  # a: a decode step's cost that does not grow with the batch
    decode_s_per_seq: float        # c_d: what each sequence in the batch adds to a decode step
    max_num_seqs: int
    kv_tokens: int                 # tokens the KV pool holds
    measured_in_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return 1.0 / self.prefill_s_per_token

    def decode_tok_s(self, batch: int) -> float:
        """Output tokens/s of `batch` sequences decoding together."""
        return batch / (self.step_s + self.decode_s_per_seq * batch)

    def max_batch(self, prompt_tokens: float, output_tokens: float) -> int:
        return int(max(1, min(self.max_num_seqs, 0.9 * self.kv_tokens // max(1.0, prompt_tokens + output_tokens))))

    def req_per_s(self, prompt_tokens: float, output_tokens: float) -> float:
        """λ_max for requests of `prompt_tokens` computed prompt tokens and `output_tokens` outputs (means)."""
        b = self.max_batch(prompt_tokens, output_tokens)
        per_req = (output_tokens * (self.step_s / b + self.decode_s_per_seq)
                   + prompt_tokens * self.prefill_s_per_token)
        return 1.0 / max(per_req, 1e-9)

    def describe(self, prompt_tokens: float, output_tokens: float) -> str:
        b = self.max_batch(prompt_tokens, output_tokens)
        return (f"measured: prefill {self.prefill_tok_s:,.0f} tok/s, decode {self.decode_tok_s(1):,.0f} tok/s at "
                f"batch 1 and {self.decode_tok_s(b):,.0f} at batch {b}")


def _params(max_tokens: int):
    from engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run_together(loop, prompts: list[list[int]], max_tokens: int, timeout: float) -> list:
    streams = [loop.submit(p, _params(max_tokens), request_id=f"calib-{time.monotonic_ns()}-{i}")
               for i, p in enumerate(prompts)]
    return [s.result(timeout) for s in streams]


def _tpot(outs) -> float:
    per = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.token_ids) - 1) for o in outs
           if len(o.token_ids) > 1 and o.metrics.last_token_time and o.metrics.first_token_time]
    return statistics.median(per)


def measure_capacity(loop, vocab_size: int, special_ids=(), seed: int = 1234, decode_steps: int = 8,
                     timeout: float = 300.0) -> Capacity:
    """Run three small batches through `loop` (EngineLoop.submit): prefill-only prompts, then decodes at two
    batch sizes. About 5 s on an idle 2-core CPU with SmolLM2-135M, well under one on a GPU."""
    eng = loop.engine
    cfg = eng.config
    budget = int(cfg.scheduler_config.max_num_batched_tokens)
    max_seqs = int(cfg.scheduler_config.max_num_seqs)
    mml = int(getattr(eng, "max_model_len", None) or cfg.model_config.max_model_len or 2048)
    kv_tokens = int(eng.num_blocks) * int(eng.block_size)
    rng = np.random.default_rng(seed)
    banned = set(int(t) for t in special_ids)
    pool = np.array([t for t in range(min(vocab_size, 50_000)) if t not in banned])

    def prompt(n: int) -> list[int]:
        return rng.choice(pool, size=n).tolist()

    t_start = time.perf_counter()
    # prefill: a few prompts of up to one step budget each, one output token
    plen = max(16, min(128, budget, mml // 2))
    n_pre = max(2, min(4, kv_tokens // (2 * plen), max_seqs))
    outs = _run_together(loop, [prompt(plen) for _ in range(n_pre)], 1, timeout)
    start = min(o.metrics.first_scheduled_time or o.metrics.arrival_time for o in outs)
    end = max(o.metrics.first_token_time for o in outs)
    c_p = max(end - start, 1e-6) / (n_pre * plen)
    # decode at two batch sizes: TPOT(b) = a + c_d * b
    steps = max(4, min(decode_steps, mml - 9))
    b2 = max(2, min(32, max_seqs, kv_tokens // (8 + steps + 16)))
    b1 = max(1, min(4, b2 // 8))
    t1 = _tpot(_run_together(loop, [prompt(8) for _ in range(b1)], steps, timeout))
    t2 = _tpot(_run_together(loop, [prompt(8) for _ in range(b2)], steps, timeout))
    c_d = max(0.0, (t2 - t1) / (b2 - b1))
    a = max(t1 - c_d * b1, 0.05 * t1)
    return Capacity(prefill_s_per_token=c_p, step_s=a, decode_s_per_seq=c_d, max_num_seqs=max_seqs,
                    kv_tokens=kv_tokens, measured_in_s=time.perf_counter() - t_start)
