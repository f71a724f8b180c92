"""GPU-only: per-region timings of graph-replayed decoding (graph_timing_interval) with unchanged outputs."""
import pytest
import torch

from engine import LLMEngine
from helpers import add_random_requests, drain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run(**cfg):
    eng = LLMEngine(model="dummy:qwen2-0.5b", device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16,
                    max_num_batched_tokens=256, num_kv_blocks=256, **cfg)
    steps = []
    eng.events.subscribe(lambda ev: steps.append(ev) if getattr(ev, "kind", "") == "step" else None)
    ids = add_random_requests(eng, (5, 300, 37, 129, 64, 1, 17, 250), max_tokens=48, vocab=150000)
    outs = drain(eng)
    return [outs[i].token_ids for i in ids], steps


@pytest.mark.parametrize("multi", [1, 8])
def test_graph_replayed_decoding_carries_sampled_timings(multi):
    ref, ref_steps = run(graph_timing_interval=0, num_scheduler_steps=multi)
    assert any(s.cuda_graph for s in ref_steps)
    assert not any(s.timings_sampled or "attention" in s.timings for s in ref_steps if s.cuda_graph)
    tokens, steps = run(graph_timing_interval=4, num_scheduler_steps=multi)
    assert tokens == ref                                       # a timed eager step computes the same tokens
    sampled = [s for s in steps if s.timings_sampled]
    assert sampled and any(s.cuda_graph for s in steps)        # graphs still replay between samples
    for s in sampled:
        assert s.timings["attention"] > 0 and s.timings["mlp"] > 0 and s.timings["lm_head"] > 0
    assert all(s.memory and s.memory["allocated"] > s.memory["kv_pool"] > 0 for s in steps)
