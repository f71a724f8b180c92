"""Bad input gets a clear ValueError naming the field and the limit, and the engine keeps serving."""
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runtime.async_engine import EngineLoop
from engine.events import StepEvent


@pytest.fixture(scope="module")
def eng():
    return LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, block_size=16, max_model_len=512)


def _serves(eng):
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished and o.request_id == rid]
    assert len(outs) == 1 and len(outs[0].token_ids) == 3


@pytest.mark.parametrize("make, match", [
    (lambda e: e.add_request("", SamplingParams()), r"prompt: must not be empty"),
    (lambda e: e.add_request([], SamplingParams()), r"prompt: must contain at least one token"),
    (lambda e: e.add_request([1] * 600, SamplingParams()), r"prompt: 600 tokens is too long; max_model_len is 512"),
    (lambda e: e.add_request([10**9], SamplingParams()), r"prompt: token ids must be ints in \[0, 49152\)"),
    (lambda e: e.add_request([1, 2], SamplingParams(max_tokens=0)), r"SamplingParams.max_tokens: must be an int in \[1, 2\*\*63\)"),
    (lambda e: e.add_request([1, 2], SamplingParams(temperature=-1)), r"SamplingParams.temperature: must be in \[0, 1e\+30\]"),
    (lambda e: e.add_request([1, 2], SamplingParams(top_p=0)), r"SamplingParams.top_p: must be in \(0, 1\]"),
    (lambda e: e.add_request([1, 2], SamplingParams(top_p=1.5)), r"SamplingParams.top_p"),
    (lambda e: e.add_request([1, 2], SamplingParams(logprobs=99)), r"SamplingParams.logprobs: must be None or an int in \[0, 20\]"),
    (lambda e: e.add_request(123, SamplingParams()), r"prompt: must be a string or a list of token ids"),
])
def test_bad_requests(eng, make, match):
    with pytest.raises(ValueError, match=match):
        make(eng)
    _serves(eng)


@pytest.mark.slow
def test_request_larger_than_pool():
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=5, block_size=16)
    assert eng.max_model_len == 64               # derived from the pool when not given
    rid = eng.add_request([1] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished and o.request_id == rid]
    assert done[0].finish_reason == "length" and len(done[0].token_ids) == 54   # capped at max_model_len
    _serves(eng)


@pytest.mark.parametrize("cfg, match", [
    (dict(block_size=3), r"EngineConfig.block_size: must be a power of two"),
    (dict(num_kv_blocks=1), r"EngineConfig.num_kv_blocks: must be None or an int >= 2"),
    (dict(scheduling="fifo"), r"EngineConfig.scheduling: must be one of"),
    (dict(kernels="cuda"), r"EngineConfig.kernels"),
    (dict(max_num_seqs=0), r"EngineConfig.max_num_seqs"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
     r"EngineConfig.max_num_batched_tokens: must be >= max_model_len \(1024\)"),
    (dict(enable_kv_cache=False, speculative_method="ngram"), r"EngineConfig.speculative_method: needs the KV cache"),
    (dict(gemv_variant="wide"), r"EngineConfig.gemv_variant: must be one of \('auto', 'tiled', 'persistent'\)"),
    (dict(fused_qk_norm=1), r"EngineConfig.fused_qk_norm: must be a bool"),
    (dict(sampler_one_launch=None), r"EngineConfig.sampler_one_launch: must be a bool"),
    (dict(enable_pdl="yes"), r"EngineConfig.enable_pdl: must be None, True or False"),
])
def test_bad_configs(cfg, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**cfg)


def test_config_that_cannot_fit_one_sequence():
    with pytest.raises(ValueError, match=r"EngineConfig.num_kv_blocks: 3 usable blocks of 16 tokens hold 48 tokens"):
        LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=4, max_model_len=100)


def test_unknown_model_path():
    with pytest.raises(ValueError, match=r"model: '/nonexistent/x' is neither a folder with config.json"):
        LLMEngine(model="/nonexistent/x", device="cpu")
    with pytest.raises(ValueError, match=r"model: unknown preset 'nope'"):
        LLMEngine(model="dummy:nope", device="cpu")


def test_loop_submit_stream_cancel_frees_blocks():
    loop = EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=64))
    # 10 ms per step (listeners run on the engine thread, which then yields the GIL): the 400 tokens would
    # take 4 s, so the cancel below always lands first, however busy the machine
    loop.engine.events.subscribe(lambda ev: time.sleep(0.01) if isinstance(ev, StepEvent) else None)
    loop.start()
    try:
        with pytest.raises(ValueError, match="prompt: must not be empty"):
            loop.submit("", SamplingParams())
        long = loop.submit([3] * 20, SamplingParams(max_tokens=400, ignore_eos=True))
        ok = loop.submit("hello there", SamplingParams(max_tokens=5, ignore_eos=True))
        first = next(iter(long))
        assert first.token_ids
        long.cancel()
        final = long.result(timeout=30)
        assert final.finish_reason == "abort" and len(final.token_ids) < 400
        assert ok.result(timeout=30).finish_reason == "length"
        chunks = list(loop.submit("again", SamplingParams(max_tokens=4, ignore_eos=True)))
        assert sum(len(c.delta_token_ids) for c in chunks) == 4 and chunks[-1].finished
        stats = loop.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] - 1 and stats["num_running"] == 0
    finally:
        loop.shutdown()
