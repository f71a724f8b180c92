"""The padded (batch, Q) layout that verify and self-drafting steps replay under CUDA graphs, checked on CPU:
the graph runner's static-buffer forward runs eagerly (capture=False; the torch kernels, which read the padded
host lengths the graph bakes in), and greedy output must equal plain decoding, alone, batched and under
preemption."""
import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.worker.cuda_graphs import CudaGraphRunner
from helpers import SPEC_VOCAB, check_no_leak, drain

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(target, n, num_kv_blocks=200, graphs=True, **spec):
    eng = LLMEngine(model=target, device="cpu", dtype="float32", block_size=4, max_model_len=64,
                    num_kv_blocks=num_kv_blocks, max_num_batched_tokens=64, max_num_seqs=8,
                    speculative_auto_off=False, spec_cuda_graph_max_batch=4, **spec)
    keys = []
    if graphs:
        g = CudaGraphRunner(eng.runner, eng.config, capture=False)
        replay = g._replay
        g._replay = lambda key, md: (keys.append(key), replay(key, md))[1]
        eng.runner.graphs = g
    rng = random.Random(7)
    for i in range(n):
        body = [rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(3, 12))]
        eng.add_request(body * 2, SamplingParams(temperature=0.0, max_tokens=rng.randrange(12, 24), ignore_eos=True))
    outs = {rid: o.token_ids for rid, o in drain(eng).items()}
    check_no_leak(eng)
    return [outs[k] for k in sorted(outs)], keys, eng.stats()


@pytest.mark.parametrize("n, blocks", [(1, 200), (6, 200), (6, 17)], ids=["alone", "batched", "preemption"])
def test_padded_verify_and_draft_layout_is_lossless(spec_models, n, blocks):
    target = spec_models["target"]
    ref, _, _ = _run(target, n, num_kv_blocks=blocks, graphs=False)
    for spec in (dict(speculative_method="ngram", num_speculative_tokens=3),
                 dict(speculative_method="self", num_speculative_tokens=2, draft_layers=2)):
        got, keys, st = _run(target, n, num_kv_blocks=blocks, **spec)
        assert got == ref, spec
        assert st["spec_decode_num_drafts"] > 0
        assert any(q > 1 for _, q, _ in keys)                       # verify steps took the padded layout
        if n > 1:
            assert any(P > 1 for P, q, _ in keys if q > 1)           # batched verify steps, padded batch
        if spec["speculative_method"] == "self":
            assert any(layers == 2 for _, _, layers in keys)         # draft steps replayed the first layers
        if blocks < 50:
            assert st["num_preemptions_total"] > 0
