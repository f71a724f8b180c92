"""Speculative decoding: drafters (n-gram, draft model, self-speculative layer skip) and lossless verification.

`make_drafter(engine)` builds the drafter named by `engine.config.speculative_config.speculative_method`; the
engine calls its propose / verify / accept / pop_step_stats / total_stats hooks (see base.py).
"""
from __future__ import annotations

from engine.spec.base import Drafter
from engine.spec.stats import SpecStats, acceptance_rate, mean_acceptance_length
from engine.spec.fast_verify import FastVerify
from engine.spec.model_drafter import ModelDrafter
from engine.spec.ngram import NgramDrafter, ngram_propose
from engine.spec.rejection import greedy_accept, rejection_sample


def make_drafter(engine) -> Drafter:
    method = engine.config.speculative_config.speculative_method
    if method == "ngram":
        return NgramDrafter(engine)
    if method == "self":
        return ModelDrafter(engine, self_speculative=True)
    if method == "draft":
        return ModelDrafter(engine, self_speculative=False)
    raise ValueError(f"EngineConfig.speculative_method: unknown method {method!r}")


__all__ = ["make_drafter", "Drafter", "FastVerify", "NgramDrafter", "ModelDrafter", "SpecStats", "ngram_propose",
           "rejection_sample", "greedy_accept", "acceptance_rate", "mean_acceptance_length"]
