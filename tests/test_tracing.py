"""OpenTelemetry request traces (--otlp-traces-endpoint): one `llm_request` span per finished engine request with
vLLM's gen_ai.* attributes and a child span per phase, exported to an in-process exporter through a real server."""
import time

import pytest
from openai import OpenAI

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from engine import EngineConfig  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app, main  # noqa: E402
from engine.entrypoints.openai.tracing import RequestTracer  # noqa: E402
from engine.runtime.async_engine import EngineLoop  # noqa: E402

MODEL = "dummy:tiny"


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter=exporter)
    with EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256,
                                 max_num_seqs=4)) as loop:
        with ServerThread(build_app(loop, tracer=tracer)) as srv:
            yield OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60), exporter


def spans_of(exporter, n: int, timeout: float = 30.0) -> list:
    """The exported spans once `n` request spans arrived (the last chunk is sent before the span ends)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        spans = exporter.get_finished_spans()
        if sum(s.name == "llm_request" for s in spans) >= n:
            return list(spans)
        time.sleep(0.02)
    raise AssertionError(f"fewer than {n} llm_request spans within {timeout} s")


def test_one_span_per_request_with_phases_and_vllm_attributes(traced):
    client, exporter = traced
    exporter.clear()
    t0 = time.time_ns()
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.5, top_p=0.9,
                                    extra_body={"ignore_eos": True})
    t1 = time.time_ns()
    spans = spans_of(exporter, 1)
    (req,) = [s for s in spans if s.name == "llm_request"]
    a = req.attributes
    assert a["gen_ai.response.model"] == MODEL and a["gen_ai.request.n"] == 1
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.prompt_tokens"] == 4 and a["gen_ai.usage.completion_tokens"] == 6
    assert a["gen_ai.usage.completion_tokens"] == out.usage.completion_tokens
    assert a["kvscope.finish_reason"] == "length" and a["kvscope.num_preemptions"] == 0
    ttft, e2e, queue = (a["gen_ai.latency.time_to_first_token"], a["gen_ai.latency.e2e"],
                        a["gen_ai.latency.time_in_queue"])
    assert 0 <= queue <= ttft <= e2e <= (t1 - t0) / 1e9
    assert a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"] == \
        pytest.approx(a["gen_ai.latency.time_in_model_inference"], abs=1e-6)
    # the span covers the request, in wall-clock time: it starts after the client sent it, ends before the reply
    assert t0 <= req.start_time <= req.end_time <= t1
    assert req.end_time - req.start_time == pytest.approx(e2e * 1e9, abs=2e6)
    phases = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == req.context.span_id}
    assert sorted(phases) == ["decode", "prefill", "queued"]
    q, p, d = phases["queued"], phases["prefill"], phases["decode"]
    assert req.start_time == q.start_time and q.end_time == p.start_time and p.end_time == d.start_time
    assert d.end_time <= req.end_time
    assert (p.end_time - req.start_time) / 1e9 == pytest.approx(ttft, abs=1e-6)


def test_n_choices_each_get_a_span_in_the_clients_trace(traced):
    client, exporter = traced
    exporter.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    client.completions.create(model=MODEL, prompt=[9, 10], max_tokens=3, n=2, extra_body={"ignore_eos": True},
                              extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    reqs = [s for s in spans_of(exporter, 2) if s.name == "llm_request"]
    assert len(reqs) == 2 and len({s.attributes["gen_ai.request.id"] for s in reqs}) == 2
    assert all(s.attributes["gen_ai.request.n"] == 2 for s in reqs)
    assert all(format(s.context.trace_id, "032x") == trace_id for s in reqs)
    assert all(format(s.parent.span_id, "016x") == "00f067aa0ba902b7" for s in reqs)


def test_an_empty_endpoint_is_a_cli_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", MODEL, "--device", "cpu", "--otlp-traces-endpoint", ""])
    assert e.value.code == 2
    assert "--otlp-traces-endpoint" in capsys.readouterr().err
