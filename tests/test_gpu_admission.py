"""GPU-only: a pool-sized max_num_seqs on a large GPU, and decode graphs above 256 sequences (LM head after the
replay) giving the logits of eager steps (skipped on CPU)."""
import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.core.sizing import derive_max_num_seqs
from engine.worker.cuda_graphs import LOGITS_GRAPH_MAX_BATCH

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_default_max_num_seqs_follows_the_pool_and_graphs_cover_it():
    eng = LLMEngine(model="dummy:llama-3.2-1b", device="cuda", max_model_len=1024)
    n = eng.config.scheduler_config.max_num_seqs
    assert n == derive_max_num_seqs(eng.num_blocks, eng.block_size)
    if torch.cuda.get_device_properties(0).total_memory > 70 * 2**30:
        assert n == 1024                               # an H100 / H200 holds far more than 1024 x 512 tokens
    assert eng.runner.graphs.sizes[-1] >= n


def _run(graphs: bool, n: int):
    eng = LLMEngine(model="dummy:qwen2-0.5b", device="cuda", dtype="float32", max_model_len=256, max_num_seqs=n,
                    max_num_batched_tokens=4096, num_kv_blocks=8 * n, enable_cuda_graphs=graphs,
                    num_scheduler_steps=1)
    logs = []
    execute = eng.runner.execute

    def spy(ids, md):
        out = execute(ids, md)
        if md.max_seqlen_q == 1:
            logs.append((md.graphed, md.num_seqs, out.cpu()))
        return out
    eng.runner.execute = spy
    for i in range(n):
        eng.add_request([3 + i % 1000, 7, 11 + i % 13], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    return logs


def test_large_decode_graph_matches_eager_logits():
    n = LOGITS_GRAPH_MAX_BATCH + 44                     # pads to a 304-row graph
    ref, got = _run(False, n), _run(True, n)
    big = [(a, b) for a, b in zip(got, ref) if a[1] > LOGITS_GRAPH_MAX_BATCH]
    assert big and all(g for (g, _, _), _ in big)
    for (_, _, a), (_, _, b) in big:
        assert (a - b).abs().max().item() < 2e-3 * max(1.0, b.abs().max().item())
