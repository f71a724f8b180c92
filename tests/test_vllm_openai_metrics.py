"""Ported from vLLM's tests/entrypoints/openai/test_metrics.py: the Prometheus families a vLLM dashboard reads,
their counts after a known workload, and running / waiting / KV usage back to zero after aborts.

Adaptations, common to every test (each test notes its own):
- vLLM's async client + pytest-asyncio (and `requests`) -> the official `openai` clients and httpx.
- TinyLlama -> `dummy:tiny` (random weights, SmolLM2's tokenizer); the server fixture's one configuration instead
  of vLLM's four server flags (chunked prefill is always on; the front end is one process here).
- The `vllm:` prefix -> `kvscope:`. vLLM's deprecated series shown only with `--show-hidden-metrics-for-version`
  (`gpu_cache_usage_perc`, `gpu_prefix_cache_*`, `time_per_output_token_seconds`) and its multimodal cache
  families do not exist here, so they are not expected.
"""
import asyncio
import time

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

import vllm_openai_server
from vllm_openai_server import MODEL_NAME

server, client = vllm_openai_server.server, vllm_openai_server.client   # fixtures: one server for this file

pytestmark = pytest.mark.usefixtures("one_thread")

_PROMPT = "Hello my name is Robert and I love magic"

EXPECTED_METRICS = [
    "kvscope:num_requests_running",
    "kvscope:num_requests_waiting",
    "kvscope:kv_cache_usage_perc",
    "kvscope:prefix_cache_queries",
    "kvscope:prefix_cache_hits",
    "kvscope:num_preemptions_total",
    "kvscope:prompt_tokens_total",
    "kvscope:generation_tokens_total",
    "kvscope:iteration_tokens_total",
    "kvscope:cache_config_info",
    "kvscope:request_success_total",
    *(f"kvscope:{family}_{suffix}" for family in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds") for suffix in ("sum", "bucket", "count")),
]


def _scrape(server) -> dict[str, float]:
    """{sample name: value summed over its label sets}; bucket samples are left out."""
    r = httpx.get(server.url_for("metrics"), timeout=30)
    assert r.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def _get_expected_values(num_requests: int, prompt_ids: list[int], max_tokens: int):
    num_prompt_tokens = len(prompt_ids)
    # {metric_family: [(suffix, expected_value)]}; vLLM's deprecated time_per_output_token_seconds (one sample
    # per token) is left out, its request_time_per_output_token_seconds (one per request) is kept
    return {
        "kvscope:time_to_first_token_seconds": [("_count", num_requests)],
        "kvscope:request_time_per_output_token_seconds": [("_count", num_requests)],
        "kvscope:inter_token_latency_seconds": [("_count", num_requests * (max_tokens - 1))],
        "kvscope:e2e_request_latency_seconds": [("_count", num_requests)],
        "kvscope:request_queue_time_seconds": [("_count", num_requests)],
        "kvscope:request_inference_time_seconds": [("_count", num_requests)],
        "kvscope:request_prefill_time_seconds": [("_count", num_requests)],
        "kvscope:request_decode_time_seconds": [("_count", num_requests)],
        "kvscope:request_prompt_tokens": [("_sum", num_requests * num_prompt_tokens), ("_count", num_requests)],
        "kvscope:request_generation_tokens": [("_sum", num_requests * max_tokens), ("_count", num_requests)],
        "kvscope:request_params_n": [("_count", num_requests)],
        "kvscope:request_params_max_tokens": [("_sum", num_requests * max_tokens), ("_count", num_requests)],
        "kvscope:iteration_tokens_total": [("_sum", num_requests * (num_prompt_tokens + max_tokens)),
                                           ("_count", num_requests * max_tokens)],
        "kvscope:prompt_tokens": [("_total", num_requests * num_prompt_tokens)],
        "kvscope:generation_tokens": [("_total", num_requests * max_tokens)],
        "kvscope:request_success": [("_total", num_requests)],
    }


def test_metrics_counts(server, client):
    # Adapted: counts are read as the difference of two scrapes (the server is shared by this file's tests);
    # ignore_eos, so that the random-weight model generates exactly max_tokens (TinyLlama does not stop early on
    # this prompt); request_success is summed over its finished_reason labels.
    prompt_ids = server.tokenizer.encode(_PROMPT)
    num_requests = 10
    max_tokens = 10
    before = _scrape(server)
    for _ in range(num_requests):
        client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True})
    after = _scrape(server)
    for family, suffix_values in _get_expected_values(num_requests, prompt_ids, max_tokens).items():
        for suffix, expected in suffix_values:
            name = family + suffix
            assert name in after, f"Did not find {name} in prom endpoint"
            got = after[name] - before.get(name, 0.0)
            assert got == expected, f"{name} expected value of {expected} did not match found value {got}"


def test_metrics_exist(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    text = httpx.get(server.url_for("metrics"), timeout=30).text
    for metric in EXPECTED_METRICS:
        assert metric in text, metric


def _wait_for(server, ok, timeout: float = 60.0) -> tuple[float, float, float]:
    """Poll (running, waiting, kv usage) until ok(...) holds; fail after `timeout` (a hang's bound, not a result)."""
    t_end = time.monotonic() + timeout
    while True:
        v = _scrape(server)
        state = (v["kvscope:num_requests_running"], v["kvscope:num_requests_waiting"],
                 v["kvscope:kv_cache_usage_perc"])
        if ok(*state) or time.monotonic() > t_end:
            return state
        time.sleep(0.02)


def test_abort_metrics_reset(server):
    # Adapted: vLLM sleeps 0.5 s for the requests to start and 1 s for the aborts; here the gauges are polled
    # until they show the requests running, then until they are back at zero (the waits only bound a hang).
    prompt_ids = server.tokenizer.encode(_PROMPT)
    assert _wait_for(server, lambda r, w, kv: r == w == kv == 0) == (0, 0, 0.0)

    async def run():
        aclient = AsyncOpenAI(base_url=server.url_for("v1"), api_key="token-abc123", max_retries=0, timeout=120)
        tasks = [asyncio.create_task(aclient.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=500,
                                                                temperature=0.0, extra_body={"ignore_eos": True}))
                 for _ in range(3)]
        running, _, kv = await asyncio.to_thread(_wait_for, server, lambda r, w, kv: r > 0 and kv > 0)
        assert running > 0 and kv > 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await aclient.close()

    asyncio.run(run())
    running, waiting, kv = _wait_for(server, lambda r, w, kv: r == w == kv == 0)
    assert running == 0, f"Expected 0 running requests after abort, got {running}"
    assert waiting == 0, f"Expected 0 waiting requests after abort, got {waiting}"
    assert kv == 0, f"Expected 0% KV cache usage after abort, got {kv}"
