"""Streamed responses: outputs a response has not sent yet are merged into one chunk (fewer, fuller SSE events)
without changing the text, the token ids or the per-token logprobs a client reassembles."""
import asyncio
import json
import time

import pytest

from engine import EngineConfig, SamplingParams
from engine.entrypoints.openai.job import Job, SSEResponse, merge_outputs
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_engine import STREAM_CHUNK_RATE, OpenAIServing
from engine.outputs import RequestMetrics, RequestOutput
from engine.runtime.async_engine import EngineLoop


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=128, block_size=16,
                                 max_model_len=512, max_num_seqs=4)) as lp:
        yield lp


def _serving(loop, **kw) -> OpenAIServing:
    return OpenAIServing(lambda: loop, None, None, None, 1 << 20, 1, None, **kw)


def _job(serving, loop, streams, prompts, params) -> Job:
    return Job(serving, loop, [s.request_id for s in streams], streams, prompts, list(range(len(streams))), params)


async def _chunks(serving, loop, streams, prompts, params, req) -> list[dict]:
    """The SSE chunks a streamed completion of these engine streams sends (attached once they have all ended)."""
    job = _job(serving, loop, streams, prompts, params)
    job.id_base = "t"
    job.attach()
    out = []
    async for frame in OpenAIServingCompletion(serving).completion_stream_generator(req, job, None):
        body = frame.removeprefix("data: ").strip()
        if body != "[DONE]":
            out.append(json.loads(body))
    return out


def test_merge_outputs_joins_deltas_and_keeps_the_last_state():
    m = RequestMetrics(arrival_time=0.0)
    outs = [RequestOutput("r", None, [1], "ab"[:k], [5, 6, 7][:k], d, ids, k == 3, "length" if k == 3 else None, m)
            for k, d, ids in ((1, "a", [5]), (2, "b", [6]), (3, "", [7]))]
    merged = merge_outputs(outs)
    assert (merged.delta_text, merged.delta_token_ids) == ("ab", [5, 6, 7])
    assert merged.finished and merged.finish_reason == "length" and merged.token_ids == [5, 6, 7]
    assert outs[0].delta_token_ids == [5]                       # the inputs are left as they were


def test_a_backlog_goes_out_as_one_chunk_with_the_same_text_tokens_and_logprobs(loop):
    """A response attached after its request ended has every step's output queued: it sends one content chunk
    whose text, token ids and logprobs are those of the step-by-step outputs joined, and of the whole result."""
    tok = loop.engine.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    stream = loop.submit(prompt, params)
    final = stream.result(timeout=120)
    steps = [o for o in stream]
    assert len(steps) > 1 and sum(len(o.delta_token_ids) for o in steps) == 12   # one output per engine step
    serving = _serving(loop)
    req = CompletionRequest(model="dummy:tiny", prompt=prompt, max_tokens=12, stream=True, logprobs=2,
                            return_token_ids=True, ignore_eos=True)
    chunks = asyncio.run(_chunks(serving, loop, [stream], [prompt], [params], req))
    content = [c["choices"][0] for c in chunks if c["choices"]]
    assert len(content) == 1
    ch = content[0]
    assert ch["text"] == "".join(o.delta_text for o in steps) == final.text
    assert ch["token_ids"] == [t for o in steps for t in o.delta_token_ids] == list(final.token_ids)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert lp["token_logprobs"] == [e[0].logprob for e in final.logprobs]
    assert "".join(lp["tokens"]) == final.text
    assert ch["finish_reason"] == "length"


def test_outputs_of_several_choices_merge_per_choice_and_keep_their_order(loop):
    """Two requests of one job, both ended before the reader comes: one output per choice, each the join of
    its own deltas (another choice's outputs in between never mix in)."""
    tok = loop.engine.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("Once upon a time", "In a hole in the ground")]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 5)]
    streams = loop.submit_many([(p, sp, None) for p, sp in zip(prompts, params)])
    finals = [s.result(timeout=120) for s in streams]
    serving = _serving(loop)
    job = _job(serving, loop, streams, prompts, params)

    async def read():
        job.attach()
        return [(i, o) async for i, o in job.outputs()]

    got = asyncio.run(read())
    assert sorted(i for i, _ in got) == [0, 1]
    for i, out in got:
        assert out.finished and out.delta_token_ids == list(finals[i].token_ids)
        assert out.delta_text == finals[i].text


def test_a_subscribed_stream_lets_go_of_each_output_once_handed_over(loop):
    """A server follows a stream through a subscriber; the stream then holds no output but the final one, so a
    burst's outputs die young instead of piling up for the garbage collector to walk. A stream nobody
    subscribed to still replays everything to a reader that comes late."""
    import gc
    import weakref

    class Sink:
        def __init__(self):
            self.refs, self.ended = [], asyncio.Event()

        def put_nowait(self, item):
            if isinstance(item, RequestOutput):
                self.refs.append(weakref.ref(item))
            else:
                self.ended.set()

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def follow():
        stream = loop.submit([1, 2, 3, 4, 5], params)
        sink = Sink()
        for item in stream.subscribe(asyncio.get_running_loop(), sink):
            sink.put_nowait(item)
        await asyncio.wait_for(sink.ended.wait(), 60)
        return stream, sink.refs

    stream, refs = asyncio.run(follow())
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert len(refs) >= 2 and alive == [stream.final]
    with pytest.raises(RuntimeError, match="keeps no history"):
        next(iter(stream))

    late = loop.submit([1, 2, 3, 4, 5], params)
    late.result(60)
    replay = list(late)
    assert replay[-1] is late.final and sum(len(o.delta_token_ids) for o in replay) == 24


def _token_outputs(n: int) -> list[RequestOutput]:
    """A request's n step outputs of one token each, the last one finished."""
    m = RequestMetrics(arrival_time=0.0)
    return [RequestOutput("r", None, [1], "x" * k, list(range(100, 100 + k)), "x", [99 + k], k == n,
                          "length" if k == n else None, m) for k in range(1, n + 1)]


CLOCK = [0.0, 10.0, 20.0, 25.0, 28.0, 68.0, 78.0, 88.0, 98.0, 108.0]   # ms: two close together, one after a stall


def _held_back(serving, loop, clock_ms: list[float]) -> list[tuple[float, RequestOutput]]:
    """(ms, chunk) for each chunk Job.hold_back lets out of one choice's one-token outputs arriving at clock_ms (the
    last one finished), stamped as outputs() stamps a chunk handed on."""
    job = Job(serving, loop, ["r"], [None], [[1]], [0], [SamplingParams(max_tokens=len(clock_ms))])
    sent = []
    for t, x in zip(clock_ms, _token_outputs(len(clock_ms))):
        out = job.hold_back(0, x, now=t / 1e3)
        if out is not None:
            sent.append((t, out))
            job.first_sent[0] = job.first_sent[0] or t / 1e3
            job.last_sent[0] = t / 1e3
    return sent


@pytest.mark.parametrize("interval,sizes", [(1, [1] * 10), (4, [1, 4, 4, 1]), (3, [1, 3, 3, 3]), (20, [1, 9])])
def test_stream_interval_holds_a_choices_tokens_until_it_has_that_many(loop, interval, sizes):
    """vLLM's --stream-interval: the first token leaves at once, then a chunk waits for `interval` new tokens;
    the last chunk leaves at once with whatever was held. No token is lost or reordered."""
    serving = _serving(loop, stream_interval=interval)
    sent = [o for _, o in _held_back(serving, loop, [0.0] * 10)]
    assert [len(o.delta_token_ids) for o in sent] == sizes
    assert [t for o in sent for t in o.delta_token_ids] == list(range(100, 110))
    assert sent[-1].finished and "".join(o.delta_text for o in sent) == "x" * 10


@pytest.mark.parametrize("interval,ms,sizes", [(1, 25, [1, 3, 2, 3, 1]), (2, 25, [1, 3, 2, 3, 1]),
                                               (4, 15, [1, 4, 4, 1]), (1, 5, [1, 1, 1, 1, 2, 1, 1, 1, 1])])
def test_stream_interval_ms_holds_a_choices_tokens_until_that_long_after_its_last_chunk(loop, interval, ms, sizes):
    """--stream-interval-ms: after the first token a chunk waits until it holds `interval` tokens and `ms` have
    passed since the choice's last chunk. Outputs of one token arrive at CLOCK's times: every 10 ms but for two
    close together (25, 28) and one after a stall (68); the last leaves at once."""
    serving = _serving(loop, stream_interval=interval, stream_interval_ms=ms)
    sent = [o for _, o in _held_back(serving, loop, CLOCK)]
    assert [len(o.delta_token_ids) for o in sent] == sizes
    assert [t for o in sent for t in o.delta_token_ids] == list(range(100, 110))
    assert sent[-1].finished


def _live_chunks(serving, max_tokens: int = 23) -> tuple[list[int], list[list[int]], float]:
    """A streamed completion of dummy:tiny read while the engine runs: the request's tokens, each content chunk's
    token ids, and the seconds it took."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    req = CompletionRequest(model="dummy:tiny", prompt=[1, 2, 3], max_tokens=max_tokens, stream=True,
                            return_token_ids=True, ignore_eos=True)
    loop = serving.get_loop()

    async def run():
        stream = loop.submit([1, 2, 3], params)
        return stream, await _chunks(serving, loop, [stream], [[1, 2, 3]], [params], req)

    t0 = time.perf_counter()
    stream, chunks = asyncio.run(run())
    took = time.perf_counter() - t0
    return (list(stream.result(timeout=60).token_ids), [c["choices"][0]["token_ids"] for c in chunks if c["choices"]],
            took)


def test_stream_interval_through_a_live_stream(loop):
    """A streamed completion read while the engine runs, under --stream-interval 4: every chunk between the first
    and the last carries at least 4 tokens, and the chunks' tokens are the request's."""
    tokens, content, _ = _live_chunks(_serving(loop, stream_interval=4))
    assert [t for ids in content for t in ids] == tokens
    assert all(len(ids) >= 4 for ids in content[1:-1])


@pytest.mark.parametrize("wait_ms,sizes", [(0.2, [1] * 10), (22, [1, 3, 2, 3, 1]), (200, [1, 9])])
def test_stream_interval_ms_auto_waits_by_the_servers_open_streams(loop, wait_ms, sizes):
    """--stream-interval-ms auto: the wait is the server's open streams / STREAM_CHUNK_RATE, so a server streaming
    to few clients holds nothing back and one streaming to many holds each stream's chunks longer."""
    serving = _serving(loop, stream_interval_ms="auto")
    serving.open_streams = round(wait_ms / 1e3 * STREAM_CHUNK_RATE)
    sent = [o for _, o in _held_back(serving, loop, CLOCK)]
    assert [len(o.delta_token_ids) for o in sent] == sizes
    assert [t for o in sent for t in o.delta_token_ids] == list(range(100, 110))


BLOCKS = [0.0, 21.0, 38.0, 64.0, 80.0, 104.0, 120.0, 146.0, 164.0, 224.0, 244.0, 266.0, 285.0]  # ~20 ms, one of 60


@pytest.mark.parametrize("auto,gaps", [(True, [38, 42, 40, 44, 60, 42, 19]), (False, [38, 26, 40, 42, 78, 42, 19])])
def test_stream_interval_ms_auto_sends_whole_blocks_at_an_even_pace(loop, auto, gaps):
    """Outputs arrive every 16-26 ms (decode blocks) and once after 60 ms (a prefill among them). Under auto with a
    26 ms wait each chunk holds two of them, so its gaps stay near two blocks, and the long one leaves at once; a
    fixed 26 ms lets the output after a 26 ms gap go alone, then holds one back until the long step, 78 ms on."""
    serving = _serving(loop, stream_interval_ms="auto" if auto else 26)
    serving.open_streams = round(26e-3 * STREAM_CHUNK_RATE)
    stamps = [t for t, _ in _held_back(serving, loop, BLOCKS)]
    assert [b - a for a, b in zip(stamps, stamps[1:])] == gaps


def test_sse_response_counts_its_choices_as_open_streams_while_it_is_written(loop):
    """SSEResponse adds its job's choices to the server's open streams for as long as it writes, whatever ends it."""
    serving = _serving(loop)
    job = Job(serving, loop, ["a", "b"], [None, None], [[1]], [0, 0], [SamplingParams()] * 2)
    job.closed = [True, True]                                 # nothing to abort at the end
    seen, sent = [], []

    async def body(fail: bool):
        seen.append(serving.open_streams)
        yield "data: {}\n\n"
        if fail:
            raise RuntimeError("the writer failed")

    async def send(message):
        sent.append(message["type"])

    async def receive():
        await asyncio.Event().wait()

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/", "headers": []}
    asyncio.run(SSEResponse(body(False), job)(scope, receive, send))
    with pytest.raises(RuntimeError, match="the writer failed"):
        asyncio.run(SSEResponse(body(True), job)(scope, receive, send))
    assert seen == [2, 2] and serving.open_streams == 0
    assert "http.response.body" in sent


def test_stream_interval_ms_through_a_live_stream(loop):
    """Under --stream-interval-ms 1000 a live stream's chunks after the first leave at most once a second: the
    chunks between the first and the last number at most the seconds the request took (unheld, 21 of 23)."""
    serving = _serving(loop, stream_interval_ms=1000)
    tokens, content, took = _live_chunks(serving)
    assert [t for ids in content for t in ids] == tokens
    assert len(content) - 2 <= took, (len(content), took)


def test_stream_interval_below_one_is_refused():
    from fastapi import FastAPI

    from engine.entrypoints.openai.api_server import register
    with pytest.raises(ValueError, match="stream_interval: must be an int >= 1"):
        register(FastAPI(), lambda: None, stream_interval=0)
    for bad in (-1.0, 1000.5, float("nan"), "10"):
        with pytest.raises(ValueError, match=r"stream_interval_ms: must be a number in \[0, 1000.0\] or 'auto'"):
            register(FastAPI(), lambda: None, stream_interval_ms=bad)
    assert register(FastAPI(), lambda: None, stream_interval_ms="auto").stream_interval_ms == "auto"
