"""The OpenAI-compatible server over engines of their own (not the shared module engine of test_api_server.py):
the real bundled model, the CLI's engine flags, and /metrics' engine counters under prefix caching, preemption
and speculative decoding."""
import asyncio

import pytest
from openai import AsyncOpenAI, OpenAI

from engine import EngineConfig
from engine.runtime.async_engine import EngineLoop
from engine.entrypoints.openai.api_server import ServerThread, build_app
from helpers import metric_sum, scrape_metrics, wait_idle

MODEL = "dummy:tiny"
NO_EOS = {"ignore_eos": True}


@pytest.mark.slow
def test_real_model_chat():
    lp = EngineLoop(EngineConfig(model=None, device="cpu", num_kv_blocks=40, max_model_len=512)).start()
    try:
        with ServerThread(build_app(lp)) as s:
            c = OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=60)
            model = c.models.list().data[0].id
            r = c.chat.completions.create(model=model, temperature=0, max_tokens=20,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
            assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    finally:
        lp.shutdown()


def test_cli_defaults_and_engine_flags():
    import argparse

    from engine.entrypoints.openai.api_server import (add_engine_args, add_server_args, engine_config_from_args,
                                                      server_kwargs)
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    add_engine_args(ap, defaults={"max_waiting_requests": 256})
    a = ap.parse_args(["--model", "dummy:tiny", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                       "--gpu-memory-utilization", "0.5", "--api-key", "k"])
    assert a.host == "127.0.0.1"                               # never exposed unless asked
    cfg = engine_config_from_args(a)
    assert (cfg.model_config.model, cfg.scheduler_config.max_num_seqs, cfg.cache_config.enable_prefix_caching, cfg.scheduler_config.max_waiting_requests,
            cfg.cache_config.gpu_memory_utilization) == ("dummy:tiny", 4, False, 256, 0.5)
    assert engine_config_from_args(ap.parse_args(["--max-waiting-requests", "none"])).scheduler_config.max_waiting_requests is None
    assert server_kwargs(a)["api_key"] == "k" and server_kwargs(a)["request_timeout"] == 600.0


def test_metrics_prefix_cache_preemption_and_spec_counters():
    """Engine counters on /metrics equal the engine's own: prefix-cache queries/hits, preemptions and the
    speculative-decoding counters (ngram drafter; a small pool forces preemption)."""
    lp = EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=12, block_size=16, max_model_len=160,
                                 max_num_seqs=4, speculative_method="ngram", num_speculative_tokens=3)).start()
    try:
        with ServerThread(build_app(lp)) as s:
            c = OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=120)
            rep = [7, 8, 9, 10] * 12                              # 48 repetitive tokens: the ngram drafter proposes
            c.completions.create(model=MODEL, prompt=rep, max_tokens=8, temperature=0, extra_body=NO_EOS)
            c.completions.create(model=MODEL, prompt=rep, max_tokens=8, temperature=0, extra_body=NO_EOS)

            async def crowd():                                    # 4 x (48 + 60) tokens > 11 usable blocks x 16
                ac = AsyncOpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=120)
                try:
                    return await asyncio.gather(*(ac.completions.create(
                        model=MODEL, prompt=[100 + i] + rep[1:], max_tokens=60, temperature=0, extra_body=NO_EOS)
                        for i in range(4)))
                finally:
                    await ac.close()
            assert all(r.usage.completion_tokens == 60 for r in asyncio.run(crowd()))
            wait_idle(lp)
            m = scrape_metrics(s.url)
            eng = lp.engine
            assert metric_sum(m, "kvscope:prefix_cache_queries_total") == eng.block_manager.total_queries > 0
            assert metric_sum(m, "kvscope:prefix_cache_hits_total") == eng.block_manager.total_hits >= 32   # 2nd request
            assert metric_sum(m, "kvscope:num_preemptions_total") == eng.scheduler.num_preemptions > 0
            st = eng.drafter.total_stats()
            assert metric_sum(m, "kvscope:spec_decode_num_drafts_total") == st["spec_decode_num_drafts"] > 0
            assert metric_sum(m, "kvscope:spec_decode_num_draft_tokens_total") == st["spec_decode_num_draft_tokens"] > 0
            acc = metric_sum(m, "kvscope:spec_decode_num_accepted_tokens_total")
            assert acc == st["spec_decode_num_accepted_tokens"] <= st["spec_decode_num_draft_tokens"]
            assert metric_sum(m, "kvscope:spec_decode_num_accepted_tokens_per_pos_total") == acc
            assert metric_sum(m, "kvscope:generation_tokens_total") == 8 + 8 + 4 * 60
    finally:
        lp.shutdown()
