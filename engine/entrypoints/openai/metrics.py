"""Prometheus metrics for `GET /metrics`, under vLLM's names with a `kvscope:` prefix.

Two sources, each the single source of its numbers:

- Engine state and totals (running/waiting requests, KV-cache usage, preemptions, prompt/generation
  tokens, prefix-cache queries/hits, speculative-decoding counters) are read from the engine when
  Prometheus scrapes (`EngineCollector`): the same counters `LLMEngine.stats()` reports, so they cover
  every request (HTTP, playground, in-process load) and cost nothing per step. The reads are plain
  attribute/len reads of ints and lists; they take no lock, so a scrape never waits for a step.
- Per-request histograms (TTFT, inter-token latency, TPOT, E2E latency, queue/prefill/decode time,
  prompt/generation lengths) and finish-reason counts are observed from each finished request's
  `RequestMetrics` stamps (`ServerMetrics.observe`), the engine's own timing stamps, exactly as vLLM's
  frontend observes them from its outputs. The API server observes every request it serves; other
  in-process callers may call `observe(output)` too.

Each server gets its own `CollectorRegistry`, so several apps can live in one process (tests). Under
`--api-server-count N` (`PROMETHEUS_MULTIPROC_DIR` set by the launcher) a scrape sums every API server process's
counters and histograms (prometheus_client's `MultiProcessCollector`) beside this process's engine collector.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine.runtime.llm_engine import ITERATION_TOKEN_BUCKETS

PREFIX = "kvscope:"

# Seconds. Finer at the low end than vLLM's so GPU-speed latencies resolve too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")
API_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/invocations")


class EngineCollector(Collector):
    """Engine gauges and counters, read at scrape time from the current EngineLoop.

    get_loop() returns the loop (or None while there is no engine: then nothing is reported; counters
    restart from zero when the engine is rebuilt, which Prometheus' rate() treats as a counter reset).
    model_name(loop) gives the `model_name` label."""

    def __init__(self, get_loop: Callable[[], Any], model_name: Callable[[Any], str]):
        self.get_loop = get_loop
        self.model_name = model_name

    def collect(self):
        """One series per engine replica, labelled engine="0", "1", ... as vLLM's (one replica without data
        parallelism)."""
        loop = self.get_loop()
        eng = getattr(loop, "engine", None)
        if eng is None:
            return
        model = self.model_name(loop)
        snaps = loop.replica_stats() if hasattr(loop, "replica_stats") else [loop.metrics_snapshot()]
        labels = ["model_name", "engine"]
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(kind, name: str, doc: str, value, extra: dict | None = None, idx: int = 0) -> None:
            fam = fams.get(name)
            if fam is None:
                fam = fams[name] = kind(PREFIX + name, doc, labels=labels + list(extra or {}))
            fam.add_metric([model, str(idx)] + [str(v) for v in (extra or {}).values()], value)

        G, C = GaugeMetricFamily, CounterMetricFamily
        for i, s in enumerate(snaps):
            nb = s.get("num_blocks", eng.num_blocks)
            add(G, "num_requests_running", "Requests in the running batch.", s.get("num_running", 0), idx=i)
            add(G, "num_requests_waiting", "Requests waiting to be scheduled (incl. preempted and those not yet "
                "handed to the engine).", s.get("num_waiting", 0), idx=i)
            add(G, "kv_cache_usage_perc", "KV-cache usage: fraction of KV blocks in use (1 = 100%).",
                s.get("kv_usage", 0.0), idx=i)
            add(G, "num_kv_blocks", "KV blocks in the pool (block 0 reserved).", nb, idx=i)
            add(G, "num_free_kv_blocks", "KV blocks on the free list (cached ones included).",
                s.get("num_free_blocks", 0), idx=i)
            add(G, "cache_config_info", "KV-cache configuration.", 1, dict(
                block_size=eng.block_size, num_blocks=nb,
                enable_prefix_caching=eng.config.cache_config.enable_prefix_caching,
                max_model_len=eng.max_model_len), idx=i)
            add(G, "tensor_parallel_size", "Ranks the model is sharded over (tensor parallelism).",
                eng.config.parallel_config.tensor_parallel_size, idx=i)
            add(G, "parallel_config_info", "Parallel layout: ranks, backend, devices.", 1, dict(
                tensor_parallel_size=eng.config.parallel_config.tensor_parallel_size,
                data_parallel_size=len(snaps), layout=s.get("parallel_layout", "")), idx=i)
            add(C, "num_preemptions", "Preemptions (a running request lost its KV blocks).",
                s.get("num_preemptions_total", 0), idx=i)
            add(C, "step_failures", "Engine steps whose prepare, forward or sampling raised; the requests that "
                "caused it failed alone, the others kept running.", s.get("step_failures", 0), idx=i)
            add(C, "request_failures", "Requests failed because an engine step raised on their rows.",
                s.get("failed", 0), idx=i)
            add(C, "prompt_tokens", "Prompt tokens of requests admitted to the engine.", s.get("prompt_tokens", 0),
                idx=i)
            add(C, "generation_tokens", "Tokens generated.", s.get("generation_tokens", 0), idx=i)
            add(C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                s.get("prefix_cache_queries", 0), idx=i)
            add(C, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.get("prefix_cache_hits", 0),
                idx=i)
            counts = s.get("iteration_tokens_counts")
            if counts:
                fam = fams.get("iteration_tokens_total")
                if fam is None:
                    fam = fams["iteration_tokens_total"] = HistogramMetricFamily(
                        PREFIX + "iteration_tokens_total", "Tokens per model iteration (a step, or each iteration of "
                        "a multi-step block).", labels=labels)
                cum = list(itertools.accumulate(counts))
                fam.add_metric([model, str(i)], [(str(float(le)), c) for le, c in zip(ITERATION_TOKEN_BUCKETS, cum)]
                               + [("+Inf", cum[-1])], s.get("iteration_tokens_sum", 0))
            if "spec_decode_num_drafts" in s:
                add(C, "spec_decode_num_drafts", "Speculative drafts proposed.", s["spec_decode_num_drafts"], idx=i)
                add(C, "spec_decode_num_draft_tokens", "Draft tokens proposed.", s["spec_decode_num_draft_tokens"],
                    idx=i)
                add(C, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                    s["spec_decode_num_accepted_tokens"], idx=i)
                for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                    add(C, "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
                        n, dict(position=pos), idx=i)
        yield from fams.values()


class ServerMetrics:
    """The registry behind `GET /metrics`: engine collector + per-request histograms + API counters."""

    def __init__(self, get_loop: Callable[[], Any], model_name: Callable[[Any], str],
                 registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        engine = EngineCollector(get_loop, model_name)
        self.registry.register(engine)
        # several API server processes: what a scrape renders is every process's files plus the engine's state
        # (this process's own metric objects would count its requests twice)
        self.exposed = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposed)
            self.exposed.register(engine)
        lab = ["model_name"]
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, lab, registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token: arrival at the server (its "
                         "connection accepted, or its first bytes read) -> the first token's chunk written to the "
                         "HTTP response.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Inter-token latency: gap between consecutive outputs of a request.", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: (last token - first token) / (output tokens - 1).", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end latency: arrival at the server -> the last "
                        "output written to the HTTP response.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival -> first scheduled.", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled -> first token.", REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token -> last token.", REQUEST_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "First scheduled -> finished (prefill + decode).",
                              REQUEST_BUCKETS)
        self.params_n = hist("request_params_n", "The n (choices) of each API request.", (1, 2, 5, 10, 20))
        self.params_max_tokens = hist("request_params_max_tokens", "max_tokens of each engine request.",
                                      TOKEN_BUCKETS)
        self.success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                               lab + ["finished_reason"], registry=r)
        api = Counter(PREFIX + "api_requests", "HTTP API requests by endpoint and status code.",
                      ["endpoint", "status"], registry=r)
        self._api = api

    def observe(self, out, model_name: str, first_sent: float | None = None, last_sent: float | None = None
                ) -> None:
        """Record one finished RequestOutput. TTFT and E2E latency end when the server wrote the first and the
        last output to the HTTP response (`first_sent`, `last_sent`, when given), so they include the
        hand-over from the engine (another process, a busy event loop) that a client waits through too;
        the other histograms use the engine's stamps (RequestMetrics)."""
        reason = out.finish_reason if out.finish_reason in FINISH_REASONS else "abort"
        self.success.labels(model_name, reason).inc()
        if reason == "abort":          # cancelled/timed-out requests stay out of the latency histograms
            return
        m = out.metrics
        n = len(out.token_ids)
        h = {k: getattr(self, k).labels(model_name) for k in
             ("ttft", "itl", "tpot", "e2e", "queue", "prefill", "decode", "prompt_len", "gen_len")}
        h["prompt_len"].observe(len(out.prompt_token_ids))
        h["gen_len"].observe(n)
        first = first_sent if first_sent is not None else m.first_token_time
        if first is not None:
            h["ttft"].observe(first - m.arrival_time)
        end = last_sent if last_sent is not None else \
            (m.finished_time if m.finished_time is not None else m.last_token_time)
        if end is not None:
            h["e2e"].observe(end - m.arrival_time)
        if m.first_scheduled_time is not None:
            h["queue"].observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                h["prefill"].observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            h["decode"].observe(m.last_token_time - m.first_token_time)
        done = m.finished_time if m.finished_time is not None else m.last_token_time
        if m.first_scheduled_time is not None and done is not None:
            self.inference.labels(model_name).observe(done - m.first_scheduled_time)
        t = list(m.token_times)
        for a, b in zip(t, t[1:]):
            h["itl"].observe(b - a)
        tpot = m.tpot(n)
        if tpot is not None:
            h["tpot"].observe(tpot)

    def observe_params(self, model_name: str, n: int, max_tokens: list[int]) -> None:
        """One accepted API request: its n, and each of its engine requests' max_tokens."""
        self.params_n.labels(model_name).observe(n)
        h = self.params_max_tokens.labels(model_name)
        for m in max_tokens:
            h.observe(m)

    def count_aborted(self, model_name: str, n: int = 1) -> None:
        """Requests the server aborted (client gone, timeout) before they finished."""
        self.success.labels(model_name, "abort").inc(n)

    def count_api(self, path: str, status: int) -> None:
        endpoint = path if path in API_ENDPOINTS else "other"
        self._api.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.exposed)
