"""OpenTelemetry request traces, as vLLM's `--otlp-traces-endpoint` exports them. Optional: the OpenTelemetry SDK
and an OTLP exporter are not dependencies of kvscope (`pip install "kvscope[tracing]"`).

One span per finished engine request, named and attributed as vLLM's (`llm_request`, the `gen_ai.*` attributes),
from the moment the request reached the server to the moment its last chunk was handed to the response, with a
child span for each phase the inspector's timeline draws: `queued` (arrival -> first scheduled), `prefill` (-> first
token) and `decode` (-> finished; `kvscope.num_preemptions` counts the times it went back to the waiting queue).
A client's W3C `traceparent` header makes the span a child of the client's trace.

The engine's stamps are `time.perf_counter()` seconds (CLOCK_MONOTONIC, one clock for every process of a
machine); spans take them as wall-clock nanoseconds, shifted by the clocks' offset when the span is made."""
from __future__ import annotations

import os
import time

# vLLM's span attribute names (vllm/tracing.py SpanAttributes)
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
MAX_TOKENS = "gen_ai.request.max_tokens"
TOP_P = "gen_ai.request.top_p"
TEMPERATURE = "gen_ai.request.temperature"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_ID = "gen_ai.request.id"
REQUEST_N = "gen_ai.request.n"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
TIME_IN_INFERENCE = "gen_ai.latency.time_in_model_inference"

TRACE_HEADERS = ("traceparent", "tracestate")


def _otlp_exporter(endpoint: str):
    """vLLM's choice: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc by default, or http/protobuf."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: must be grpc or http/protobuf (got {protocol!r})")
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """Spans for finished requests. `endpoint`: an OTLP collector (batched export); `exporter`: any span exporter,
    each span exported as it ends (tests pass an in-memory one)."""

    def __init__(self, endpoint: str | None = None, *, exporter=None, service_name: str = "kvscope"):
        if exporter is None and not endpoint:
            raise ValueError("--otlp-traces-endpoint: must be a collector's address, e.g. http://127.0.0.1:4317")
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
            processor = SimpleSpanProcessor(exporter) if exporter is not None else \
                BatchSpanProcessor(_otlp_exporter(endpoint))
        except ImportError as e:
            raise ValueError(f"--otlp-traces-endpoint: OpenTelemetry is not installed ({e.name} is missing); "
                             "pip install opentelemetry-sdk opentelemetry-exporter-otlp") from e
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvscope.entrypoints.openai")
        self._server_kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self._context_of = set_span_in_context

    def trace(self, out, model_name: str, params, n: int, headers: dict | None, last_sent: float) -> None:
        """One finished RequestOutput `out` of an API request of `n` choices, sampled with `params`; `last_sent`:
        when its last chunk went to the response (perf_counter seconds)."""
        m = out.metrics
        offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        attrs = {RESPONSE_MODEL: model_name, REQUEST_ID: out.request_id, REQUEST_N: n,
                 MAX_TOKENS: params.max_tokens, TEMPERATURE: float(params.temperature), TOP_P: float(params.top_p),
                 PROMPT_TOKENS: len(out.prompt_token_ids), COMPLETION_TOKENS: len(out.token_ids),
                 E2E: last_sent - m.arrival_time, "kvscope.finish_reason": str(out.finish_reason),
                 "kvscope.num_preemptions": m.num_preemptions, "kvscope.num_cached_tokens": m.num_cached_tokens}
        sched, first, done = m.first_scheduled_time, m.first_token_time, m.finished_time or m.last_token_time
        if sched is not None:
            attrs[TIME_IN_QUEUE] = sched - m.arrival_time
        if first is not None:
            attrs[TIME_TO_FIRST_TOKEN] = first - m.arrival_time
            if sched is not None:
                attrs[TIME_IN_PREFILL] = first - sched
            if done is not None:
                attrs[TIME_IN_DECODE] = done - first
        if sched is not None and done is not None:
            attrs[TIME_IN_INFERENCE] = done - sched
        ctx = self._propagator.extract(headers) if headers else None
        span = self.tracer.start_span("llm_request", context=ctx, kind=self._server_kind, attributes=attrs,
                                      start_time=ns(m.arrival_time))
        parent = self._context_of(span)
        for name, a, b in (("queued", m.arrival_time, sched), ("prefill", sched, first), ("decode", first, done)):
            if a is not None and b is not None:
                child = self.tracer.start_span(name, context=parent, start_time=ns(a))
                if name == "decode":
                    child.set_attribute("kvscope.num_preemptions", m.num_preemptions)
                child.end(end_time=ns(b))
        span.end(end_time=ns(last_sent))

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self.provider.shutdown()


def trace_headers(headers) -> dict | None:
    """The W3C trace-context headers of a request (None without them)."""
    found = {k: headers[k] for k in TRACE_HEADERS if k in headers}
    return found or None
