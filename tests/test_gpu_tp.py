"""GPU-only, 2+ GPUs: tensor parallelism over NCCL with the Triton kernels and CUDA graphs (the all-reduces
captured inside them) gives one GPU's greedy tokens in fp32, with quantized shards and n-gram drafts too; a killed
rank is reported and stops the engine.
`bash benchmarks/gpu.sh tp` runs these beside bench_tp.py and the data-parallel serving burst."""
import os
import signal

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import add_random_requests, drain

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def run_tp(model: str | None, tp: int, vocab: int, prompts: tuple = (), **cfg):
    """fp32 greedy tokens of random prompts, then of `prompts`; with the device left as "cuda" (no index), as users
    write it. Returns (tokens, worker pids, KV blocks, whether CUDA graphs were captured, stats)."""
    eng = LLMEngine(model=model, device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=16,
                    max_num_batched_tokens=256, tensor_parallel_size=tp, **cfg)
    try:
        assert eng.device == torch.device("cuda", 0)
        ids = add_random_requests(eng, (5, 300, 37, 129, 1, 250), max_tokens=24, vocab=vocab)
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ids += [eng.add_request(p, greedy) for p in prompts]
        outs = drain(eng)
        graphed = eng.runner.graphs is not None and eng.runner.graphs.captured
        if tp > 1:                                     # two GPUs of one machine: the one-shot all-reduce
            assert (eng.executor.tp.custom is None) == bool(cfg.get("disable_custom_all_reduce"))
            assert ("one-shot" in eng.parallel_layout) == (eng.executor.tp.custom is not None)
        return ([outs[i].token_ids for i in ids], (eng.executor.pids if eng.executor else []), eng.num_blocks, graphed,
                eng.stats())
    finally:
        eng.close()


def assert_gone(pids):
    for pid in pids:                                  # close() left no worker behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_tensor_parallel_2_matches_1_fp32_llama_1b_shape():
    """Chunked prefill (256-token budget), decode and mixed CUDA graphs with the all-reduces captured,
    multi-step decode; the KV pool sized from each rank's free memory (the smaller)."""
    ref, *_ = run_tp("dummy:llama-3.2-1b", 1, 128000)
    out, pids, blocks, graphed, _ = run_tp("dummy:llama-3.2-1b", 2, 128000)
    assert graphed and blocks > 0
    assert out == ref
    assert_gone(pids)


def test_tensor_parallel_2_matches_1_with_nccl_alone():
    ref, *_ = run_tp("dummy:llama-3.2-1b", 1, 128000)
    out, pids, *_ = run_tp("dummy:llama-3.2-1b", 2, 128000, disable_custom_all_reduce=True)
    assert out == ref
    assert_gone(pids)


def test_custom_all_reduce_matches_nccl():
    """bf16 and fp32 tensors of odd sizes up to the 8 MiB limit, both receive slots, and replays of a CUDA graph
    that captured two calls: the same bits as NCCL's sum, on both ranks."""
    from benchmarks.allreduce_ranks import run
    assert run("check") == ["ok", "ok"]


def test_tensor_parallel_2_matches_1_fp32_bundled_smollm2():
    """SmolLM2's 9 heads / 3 KV heads split unevenly (6 + 3 / 2 + 1): real weights, read by slices."""
    try:
        from engine.models.loader import resolve
        resolve(None)
    except Exception as e:  # noqa: BLE001 - no bundled model on this machine (benchmarks/device_bundle.py)
        pytest.skip(f"no bundled SmolLM2: {e}")
    ref, *_ = run_tp(None, 1, 49152, num_kv_blocks=512)
    out, pids, *_ = run_tp(None, 2, 49152, num_kv_blocks=512)
    assert out == ref
    assert_gone(pids)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_tensor_parallel_2_matches_1_fp32_quantized_with_ngram_drafts(fmt):
    """Each rank quantizes its shard and runs the quantized GEMMs and GEMVs at the shard's shapes, and every rank
    verifies rank 0's n-gram drafts: TP=2 gives TP=1's tokens."""
    cfg = dict(quantization=fmt, speculative_method="ngram", speculative_auto_off=False, num_speculative_tokens=3)
    repeating = ([11 + j % 7 for j in range(60)] * 2, [7, 8, 9, 10] * 40)    # prompts that draft themselves
    ref, *_ = run_tp("dummy:llama-3.2-1b", 1, 128000, repeating, **cfg)
    out, pids, _, graphed, st = run_tp("dummy:llama-3.2-1b", 2, 128000, repeating, **cfg)
    assert graphed and st["quantization"] == fmt and st["spec_decode_num_draft_tokens"] > 0
    assert out == ref
    assert_gone(pids)


def test_tensor_parallel_killed_worker_fails_clearly():
    from engine.runtime.async_engine import EngineLoop
    loop = EngineLoop(EngineConfig(model="dummy:llama-3.2-1b", device="cuda", max_model_len=2048, num_kv_blocks=512,
                                   tensor_parallel_size=2)).start()
    try:
        (pid,) = loop.engine.executor.pids
        stream = loop.submit(list(range(100, 200)), SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))
        next(iter(stream))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited"):
            stream.result(timeout=30.0)              # the watcher ends the waits (custom all-reduce's abort word, NCCL's abort)
    finally:
        loop.shutdown()
        loop.engine.close()
