"""The OpenAI-compatible server, driven over real HTTP (uvicorn on a free port) with the official client."""
import asyncio
import json
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from engine import EngineConfig
from engine.runtime.async_engine import EngineLoop
from engine.entrypoints.openai.api_server import ServerThread, build_app
from helpers import metric_sum, scrape_metrics, wait_idle

MODEL = "dummy:tiny"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=256, block_size=16, max_model_len=1024,
                                 max_num_seqs=4, max_waiting_requests=6)) as lp:
        yield lp


@pytest.fixture(scope="module")
def guarded(loop):
    """Same engine, second app: API key, short request timeout, small body limit."""
    with ServerThread(build_app(loop, api_key="sekrit", request_timeout=0.5, max_body_bytes=4096)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(loop):
    return loop.engine.tokenizer


def sse_lines(r: httpx.Response) -> list[str]:
    return [line for line in r.iter_lines() if line]


# ------------------------------------------------------------------------------ basics
def test_models_and_health(srv, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_usage_and_stream_match(client, tok):
    prompt = "The quick brown fox jumps over"
    n_prompt = len(tok.encode(prompt, add_special_tokens=False))
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body=NO_EOS)
    c = full.choices[0]
    assert c.finish_reason == "length" and c.index == 0 and c.text
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == 7 and full.usage.total_tokens == n_prompt + 7

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sse_wire_format(srv):
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = sse_lines(r)
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_chat_stream_and_non_stream(client, tok):
    msgs = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 6 and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(msgs, tokenize=False,
                                                                              add_generation_prompt=True),
                                                      add_special_tokens=False))
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_seeds_reproducible_and_n(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, extra_body=NO_EOS)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=1235, **kw).choices[0].text
    assert a == b and a != c
    # n choices use seeds seed, seed+1, ...: each equals the single request with that seed
    many = client.completions.create(seed=1234, n=3, **kw)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.choices[0].text == a and many.choices[1].text == c
    assert len({ch.text for ch in many.choices}) == 3
    assert many.usage.completion_tokens == 24


def test_several_prompts_and_n(client, tok):
    prompts = ["Hello there", "A much longer second prompt here"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text            # greedy: same prompt, same text
    assert r.usage.prompt_tokens == sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts)
    assert r.usage.completion_tokens == 16


def test_token_id_prompt(client):
    r = client.completions.create(model=MODEL, prompt=[1000, 2000, 3000], max_tokens=3, extra_body=NO_EOS)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 3


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0, extra_body=NO_EOS)
    full = client.completions.create(max_tokens=24, **kw).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = full[:full.index(stop)]
    r = client.completions.create(max_tokens=24, stop=[stop], **kw).choices[0]
    assert r.text == want and r.finish_reason == "stop"
    streamed = list(client.completions.create(max_tokens=24, stop=stop, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    inc = client.completions.create(max_tokens=24, stop=[stop], extra_body={"ignore_eos": True,
                                    "include_stop_str_in_output": True}, model=MODEL,
                                    prompt="The capital of France is", temperature=0).choices[0]
    assert inc.text == want + stop


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=3, temperature=0,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and abs(max(top.values()) - chosen) < 1e-4   # greedy picks the top token
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    s = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            logprobs=True, stream=True, extra_body=NO_EOS))
    assert sum(len(ch.choices[0].logprobs.content) for ch in s if ch.choices and ch.choices[0].logprobs) == 3


# ------------------------------------------------------------------------------ errors
BAD = [
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "seed": "abc"}, "seed"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("completions", {"prompt": "x", "stop": 5}, "stop"),
    ("completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    # values pydantic accepts but the sampler cannot compute in fp32 (one per class)
    ("completions", {"prompt": "x", "repetition_penalty": 1e-300, "temperature": 1}, "repetition_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 1e300}, "repetition_penalty"),
    ("completions", {"prompt": "x", "temperature": 1e39}, "temperature"),
    ("completions", {"prompt": "x", "top_k": 2 ** 70}, "top_k"),
    ("completions", {"prompt": "x", "max_tokens": 2 ** 70}, "max_tokens"),
    ("completions", {"prompt": "x", "stop_token_ids": [2 ** 70]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "stop_token_ids": [10 ** 6], "min_tokens": 2}, "stop_token_ids"),
    ("completions", {"prompt": "x", "seed": 2 ** 64 - 1, "n": 2}, "seed"),
    # more sequences than the waiting queue (max_waiting_requests=6) can ever hold: no retry could help
    ("completions", {"prompt": "x", "n": 7}, "n"),
    ("completions", {"prompt": ["a", "b", "c", "d"], "n": 2}, "n"),
    ("completions", {"prompt": [[1], [2], [3], [4], [5], [6], [7]]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 7}, "n"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "stop_token_ids": [999999]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "seed": 2 ** 63}, "seed"),
    ("completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "length_penalty": 1.0}, "length_penalty"),
    ("completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": 123}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [10 ** 9]}, "prompt"),
    ("completions", {"prompt": [5] * 2000}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": True},
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("route, body, param", BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(BAD)])
def test_bad_params_400(srv, route, body, param):
    r = httpx.post(f"{srv.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("content, needle", [
    (b"{not json", "malformed JSON"), (b"[1, 2]", "JSON object"), (b"", "JSON object"), (b"\xff\xfe", "JSON"),
])
def test_malformed_body_400(srv, content, needle):
    r = httpx.post(srv.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model"


def test_engine_still_serves_after_errors(client, loop):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 2
    wait_idle(loop)


def test_api_key(guarded):
    url = guarded.url + "/v1/completions"
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 401
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0).models.list()
    ok = OpenAI(base_url=guarded.url + "/v1", api_key="sekrit", max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(guarded.url + "/health").status_code == 200     # probes stay open
    assert httpx.get(guarded.url + "/metrics").status_code == 401    # everything else needs the key
    assert httpx.get(guarded.url + "/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_body_too_large_413(guarded):
    auth = {"Authorization": "Bearer sekrit"}
    r = httpx.post(guarded.url + "/v1/completions", json={"prompt": "x" * 6000}, headers=auth)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------ faults
def test_timeout_aborts(guarded, loop):
    auth = {"Authorization": "Bearer sekrit"}
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    t0 = time.monotonic()
    r = httpx.post(guarded.url + "/v1/completions", json=body, headers=auth, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 25       # a bound on a hang, not a speed test
    wait_idle(loop)
    with httpx.stream("POST", guarded.url + "/v1/completions", json={**body, "stream": True}, headers=auth,
                      timeout=30) as r:
        lines = sse_lines(r)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
    wait_idle(loop)


def test_disconnect_mid_stream_frees_blocks(srv, loop):
    events = []
    unsub = loop.engine.events.subscribe(lambda e: events.append(e) if getattr(e, "kind", "") == "aborted" else None)
    # 5 ms per engine step (the listener runs on the engine thread): "within a few steps" then means the
    # server noticed the closed connection, not that a busy machine starved its event loop
    unslow = loop.engine.events.subscribe(lambda e: time.sleep(0.005) if hasattr(e, "scheduled") else None)
    try:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", srv.url + "/v1/completions",
                          json={"prompt": "Tell me a long story", "max_tokens": 900, "stream": True,
                                "ignore_eos": True}) as r:
                it = r.iter_lines()
                got = 0
                for line in it:
                    got += line.startswith("data: {")
                    if got == 3:
                        break
                assert loop.stats()["num_running"] == 1
                step_at_close = loop.engine.step_index
            # leaving the block closes the connection mid-stream
        s = wait_idle(loop)
    finally:
        unsub()
        unslow()
    assert len(events) == 1
    print("steps between close and abort:", events[0].step - step_at_close)
    assert events[0].step - step_at_close <= 3, (events[0].step, step_at_close)
    assert s["num_free_blocks"] == loop.engine.num_blocks - 1


def test_disconnect_while_waiting_non_stream(srv, loop):
    with pytest.raises(openai.APITimeoutError):
        OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=0.3).completions.create(
            model=MODEL, prompt="x", max_tokens=900, extra_body=NO_EOS)
    wait_idle(loop)


def test_flood_gets_503_and_accepted_complete(srv, loop):
    limit = loop.config.scheduler_config.max_waiting_requests

    async def flood():
        c = AsyncOpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60)

        async def one(i):
            try:
                if i % 2:       # streamed: an accepted stream must run to its end, never fail midway
                    text, usage = "", None
                    async for ch in await c.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=12,
                                                               stream=True, stream_options={"include_usage": True},
                                                               extra_body=NO_EOS):
                        text += ch.choices[0].text if ch.choices else ""
                        usage = ch.usage or usage
                    return usage
                return (await c.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=12,
                                                   extra_body=NO_EOS)).usage
            except openai.APIStatusError as e:
                return e
        try:
            return await asyncio.gather(*(one(i) for i in range(40)))
        finally:
            await c.close()

    results = asyncio.run(flood())
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(e.status_code == 503 for e in refused), [getattr(e, "status_code", e) for e in refused]
    assert all(e.response.headers.get("retry-after") == "1" for e in refused)
    assert refused[0].body["code"] == "queue_full"
    assert len(ok) >= limit
    assert all(u.completion_tokens == 12 for u in ok)
    wait_idle(loop)


def test_register_follows_the_current_engine(loop):
    """register(app, get_loop): no engine -> 503 (health too); an engine -> served; the loop is looked up per request."""
    from fastapi import FastAPI
    from engine.entrypoints.openai.api_server import register

    holder = {"loop": None}

    def get_loop():
        if holder["loop"] is None:
            raise RuntimeError("engine is restarting")
        return holder["loop"]

    app = FastAPI()
    register(app, get_loop)
    with ServerThread(app) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable" and r.headers["retry-after"]
        assert httpx.get(s.url + "/health").status_code == 503
        assert httpx.get(s.url + "/metrics").status_code == 200          # request metrics only, no engine
        holder["loop"] = loop
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        assert "kvscope:kv_cache_usage_perc" in httpx.get(s.url + "/metrics").text


# ------------------------------------------------------------------------------ /metrics
def test_metrics_counters_match(srv, client, loop, tok):
    wait_idle(loop)
    before = scrape_metrics(srv.url)
    prompts = ["one two three", "four five", "six seven eight nine ten"]
    for i, p in enumerate(prompts):
        client.completions.create(model=MODEL, prompt=p, max_tokens=5 + i, extra_body=NO_EOS)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=4,
                                        stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS))
    after = scrape_metrics(srv.url)
    d = lambda name, **lb: metric_sum(after, name, **lb) - metric_sum(before, name, **lb)   # noqa: E731
    chat_prompt = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False,
                                                         add_generation_prompt=True), add_special_tokens=False))
    assert d("kvscope:prompt_tokens_total") == sum(len(tok.encode(p, add_special_tokens=False))
                                                   for p in prompts) + chat_prompt
    assert d("kvscope:generation_tokens_total") == 5 + 6 + 7 + 4
    assert d("kvscope:request_success_total", finished_reason="length") == 4
    assert d("kvscope:time_to_first_token_seconds_count") == 4
    assert d("kvscope:e2e_request_latency_seconds_count") == 4
    assert d("kvscope:request_queue_time_seconds_count") == 4
    assert d("kvscope:inter_token_latency_seconds_count") == 4 + 5 + 6 + 3
    assert d("kvscope:request_generation_tokens_sum") == 22
    assert d("kvscope:api_requests_total", endpoint="/v1/completions", status="200") == 3
    assert d("kvscope:api_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert metric_sum(after, "kvscope:num_requests_running") == 0 and metric_sum(after, "kvscope:num_requests_waiting") == 0
    assert metric_sum(after, "kvscope:kv_cache_usage_perc") == 0.0
    assert metric_sum(after, "kvscope:num_free_kv_blocks") == loop.engine.num_blocks - 1
    # refused and rejected requests are counted by status
    assert metric_sum(after, "kvscope:api_requests_total", endpoint="/v1/completions", status="503") >= 1
    assert metric_sum(after, "kvscope:api_requests_total", endpoint="/v1/completions", status="400") >= 1


# ------------------------------------------------------------------------------ OpenAI / vLLM extras
def test_logit_bias_forces_and_bans_and_eos_stop_reason_null(client, loop):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, n=1,
                                  logit_bias={"42": 100}, extra_body={**NO_EOS, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [42] * 5
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0,
                                      extra_body={**NO_EOS, "return_token_ids": True}).choices[0]
    first = plain.model_extra["token_ids"][0]
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, logit_bias={str(first): -100},
                                  extra_body={**NO_EOS, "return_token_ids": True})
    assert first not in r.choices[0].model_extra["token_ids"]
    eos = min(loop.engine.eos_token_ids)
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] is None
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, logit_bias={"42": 100},
                                  extra_body={"stop_token_ids": [42]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == 42


def test_vllm_extras_shapes(client, srv):
    prompt = list(range(10, 30))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0,
                                  extra_body={**NO_EOS, "truncate_prompt_tokens": 5, "return_token_ids": True,
                                              "return_tokens_as_token_ids": True})
    c = r.choices[0]
    assert r.usage.prompt_tokens == 5 and c.model_extra["prompt_token_ids"] == prompt[-5:]
    toks = c.model_extra["token_ids"]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in toks]
    assert [list(d) for d in c.logprobs.top_logprobs] == [[f"token_id:{t}"] for t in toks]   # logprobs=0: the token
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       n=2, temperature=1.0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(ch.message.content in ("yes", "no") for ch in r.choices)
    f = httpx.post(srv.url + "/v1/completions", data={"prompt": "x"}, timeout=30)      # form-encoded
    assert f.status_code == 415 and f.json()["error"]["message"].startswith("Content-Type"), f.text


def test_echo_with_logprobs_and_prompt_logprobs(client):
    prompt = [11, 12, 13, 14]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                  extra_body={**NO_EOS, "prompt_logprobs": 1, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    assert lp.tokens[:4] == [f"token_id:{t}" for t in prompt] and len(lp.tokens) == 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and all(lp.token_logprobs[1:])
    plp = c.model_extra["prompt_logprobs"]          # vLLM's shape: the prompt token and the top-1 by id
    assert plp[0] is None and len(plp) == 4
    for k in (1, 2, 3):
        assert plp[k][str(prompt[k])]["logprob"] == pytest.approx(lp.token_logprobs[k])
        assert any(v["rank"] == 1 for v in plp[k].values())


def test_tokenizer_routes_version_invocations(srv, client, tok):
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert len(r["token_strs"]) == r["count"]
    msgs = [{"role": "user", "content": "hey"}]
    r = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                     add_special_tokens=False)
    assert httpx.post(srv.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    bad = httpx.post(srv.url + "/detokenize", json={"tokens": [10 ** 8]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    info = httpx.get(srv.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["max_model_len"] == 1024
    assert httpx.get(srv.url + "/version").json()["version"]
    chat = httpx.post(srv.url + "/invocations", json={"messages": msgs, "max_tokens": 2}, timeout=60).json()
    assert chat["object"] == "chat.completion"
    cmpl = httpx.post(srv.url + "/invocations", json={"prompt": "hi", "max_tokens": 2}, timeout=60).json()
    assert cmpl["object"] == "text_completion"


def test_vllm_metric_families(srv, client):
    before = scrape_metrics(srv.url)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, n=2, extra_body=NO_EOS)
    after = scrape_metrics(srv.url)
    for name, grew in (("kvscope:request_params_n_count", 1), ("kvscope:request_params_max_tokens_count", 2),
                       ("kvscope:request_params_max_tokens_sum", 6), ("kvscope:request_params_n_sum", 2)):
        assert metric_sum(after, name) - metric_sum(before, name) == grew, name
    assert metric_sum(after, "kvscope:request_inference_time_seconds_count") \
        - metric_sum(before, "kvscope:request_inference_time_seconds_count") == 2
    steps = metric_sum(after, "kvscope:iteration_tokens_total_count") - metric_sum(before, "kvscope:iteration_tokens_total_count")
    tokens = metric_sum(after, "kvscope:iteration_tokens_total_sum") - metric_sum(before, "kvscope:iteration_tokens_total_sum")
    assert steps >= 3 and tokens >= 2 * 3       # 2 requests x 3 tokens, prompt tokens on top (other tests may run)


def test_stream_interval_over_http(loop, client):
    """--stream-interval 3 through the official client: a streamed chat gives the non-streamed message, and
    streamed completions (two choices, logprobs) the non-streamed texts, token ids and logprobs, in chunks of at
    least 3 tokens between each choice's first and last."""
    with ServerThread(build_app(loop, stream_interval=3)) as s:
        oai = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Count to ten."}]
        kw = dict(model=MODEL, max_tokens=17, temperature=0, extra_body=NO_EOS)
        full = oai.chat.completions.create(messages=msgs, **kw).choices[0].message.content
        chunks = list(oai.chat.completions.create(messages=msgs, stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full
        body = dict(kw["extra_body"], return_token_ids=True)
        ref = client.completions.create(model=MODEL, prompt="Once upon", n=2, max_tokens=17, temperature=0,
                                        logprobs=1, extra_body=body)
        per = {0: [], 1: []}
        for ch in oai.completions.create(model=MODEL, prompt="Once upon", n=2, max_tokens=17, temperature=0,
                                         logprobs=1, stream=True, extra_body=body):
            for c in ch.choices:
                per[c.index].append(c)
        for i, got in per.items():
            assert "".join(c.text for c in got) == ref.choices[i].text
            assert [t for c in got for t in c.token_ids] == ref.choices[i].token_ids
            assert [x for c in got for x in c.logprobs.token_logprobs] == ref.choices[i].logprobs.token_logprobs
            assert all(len(c.token_ids) >= 3 for c in got[1:-1]) and got[-1].finish_reason == "length"
