"""Admission sized from the KV pool: a GPU's default max_num_seqs follows the pool (at most 1024), the decode
graphs cover it, and graphs above 256 sequences hand back hidden states (the LM head runs after the replay)
with the same tokens as eager steps."""
import pytest

from engine import SamplingParams
from engine.core import sizing
from engine.core.sizing import KV_TOKENS_PER_SEQ, MAX_NUM_SEQS_CAP, derive_max_num_seqs
from engine.runtime.llm_engine import LLMEngine
from engine.worker.cuda_graphs import LOGITS_GRAPH_MAX_BATCH, CudaGraphRunner, capture_sizes
from helpers import check_no_leak


def test_derived_max_num_seqs_follows_the_pool():
    bs = 16
    per = KV_TOKENS_PER_SEQ // bs                                   # blocks per admitted request
    assert derive_max_num_seqs(1 + 5 * per, bs) == 5                 # block 0 is the null block, never used
    assert derive_max_num_seqs(1 + 40 * per, bs) == 32               # above 16: a multiple of 16 (a graph size)
    assert derive_max_num_seqs(2, bs) == 1                           # a tiny pool still admits one request
    assert derive_max_num_seqs(1 + 10 ** 6, bs) == MAX_NUM_SEQS_CAP
    sizes = [derive_max_num_seqs(n, bs) for n in range(2, 40_000, 97)]
    assert sizes == sorted(sizes)                                    # a larger pool never admits fewer


@pytest.fixture
def pool_derived(monkeypatch):
    """The CPU default as a GPU's: max_num_seqs left to the pool."""
    monkeypatch.setitem(sizing.DEVICE_DEFAULTS, "cpu", (1024, None))


@pytest.mark.parametrize("requests_held", [4, 8])
def test_engine_admits_as_many_requests_as_its_pool_sizes(pool_derived, requests_held):
    blocks = 1 + requests_held * KV_TOKENS_PER_SEQ // 16
    eng = LLMEngine(model="dummy:tiny", device="cpu", block_size=16, num_kv_blocks=blocks, max_model_len=256)
    assert eng.config.scheduler_config.max_num_seqs == requests_held
    for i in range(3 * requests_held):
        eng.add_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.step()
    assert len(eng.scheduler.running) == requests_held
    assert len(eng.scheduler.waiting) == 2 * requests_held
    while eng.has_unfinished_requests():
        eng.step()
    check_no_leak(eng)


def test_decode_graph_sizes_cover_max_num_seqs():
    assert capture_sizes(1024)[-1] == 1024 and capture_sizes(300)[-1] == 304 and capture_sizes(256)[-1] == 256
    assert all(b - a <= 16 for a, b in zip(capture_sizes(1024), capture_sizes(1024)[1:]))


def _decode_tokens(graphs: bool, n: int) -> tuple[list, list]:
    eng = LLMEngine(model="dummy:tiny", device="cpu", dtype="float32", block_size=16, num_kv_blocks=4 * n + 8,
                    max_model_len=64, max_num_seqs=n, max_num_batched_tokens=4 * n, num_scheduler_steps=1)
    keys = []
    if graphs:
        g = CudaGraphRunner(eng.runner, eng.config, capture=False)     # the padded layout, run eagerly
        replay = g._replay
        g._replay = lambda key, md: (keys.append(key), replay(key, md))[1]
        eng.runner.graphs = g
    outs = {}
    for i in range(n):
        eng.add_request([3 + i % 50, 4 + i % 7, 9], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                        request_id=f"r{i:04d}")
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.token_ids)
    check_no_leak(eng)
    return [outs[k] for k in sorted(outs)], keys


@pytest.mark.slow
def test_large_decode_graph_computes_logits_after_the_replay():
    """A decode step of 260 requests pads to the 272-row graph, which ends at the final norm: the tokens are
    those of eager steps."""
    n = LOGITS_GRAPH_MAX_BATCH + 4
    ref, _ = _decode_tokens(False, n)
    got, keys = _decode_tokens(True, n)
    assert got == ref
    assert any(k[1] == 1 and k[0] > LOGITS_GRAPH_MAX_BATCH for k in keys)
    assert CudaGraphRunner._hidden_out((272, 1, None)) and not CudaGraphRunner._hidden_out((256, 1, None))
