"""Ported from vLLM's tests/entrypoints/openai/chat_completion/test_chat.py: /v1/chat/completions logprobs
shapes, prompt_logprobs, streaming shapes, stream_options, structured outputs (shape only), response_format,
extra fields, content parts, seed range, /invocations, n.

Adaptations, common to every test (each test notes its own):
- vLLM's async client + pytest-asyncio -> the sync official `openai` client (same requests, same asserts).
- zephyr-7b-beta (+ a LoRA) -> `dummy:tiny` (random weights, SmolLM2's tokenizer and chat template); the LoRA
  parametrizations are dropped (kvscope serves no adapters).
- Tests whose assertions are about the model's text (test_complex_message_content's "2",
  test_response_format_json_object's {"result": 2}, ...) are kept as skips with the reason.
"""
import json
import re
from collections import defaultdict

import httpx
import jsonschema
import openai
import pytest
import torch
from openai import BadRequestError

import vllm_openai_server
from vllm_openai_server import MODEL_NAME, assert_usage_after_finish

server, client = vllm_openai_server.server, vllm_openai_server.client   # fixtures: one server for this file

pytestmark = pytest.mark.usefixtures("one_thread")

NO_EOS = {"ignore_eos": True}        # adaptation: a random-weight model may sample EOS early
MESSAGES = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]
CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
# adaptation: vLLM's sample_json_schema fixture (an employee profile) cut to bounded values, so a random model
# closes the object within max_tokens
JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["age", "level"],
               "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                              "level": {"enum": ["junior", "senior"]}}}
IP_REGEX = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


def test_no_logprobs_chat(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
                                       logprobs=False)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("top_logprobs", [0, 5])       # vLLM's test_zero_logprobs_chat, test_some_logprobs_chat
def test_zero_and_some_logprobs_chat(client, top_logprobs):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
                                       logprobs=True, top_logprobs=top_logprobs)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content[0].top_logprobs) == top_logprobs


def test_too_many_chat_logprobs(client):
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        for _ in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10,
                                                logprobs=True, top_logprobs=21, stream=True):
            pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, logprobs=True,
                                       top_logprobs=30, stream=False)
    # the server should still work afterwards
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, stream=False)
    assert r.choices[0].message.content is not None


PROMPT_LOGPROBS_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"}]


def _prompt_logprobs(r):
    # adaptation: the openai client keeps unknown top-level fields in model_extra
    return (r.model_extra or {}).get("prompt_logprobs")


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(client, prompt_logprobs):
    # adaptation: max_completion_tokens=2 (vLLM leaves it unset) to keep the module fast
    params: dict = {"messages": PROMPT_LOGPROBS_MESSAGES, "model": MODEL_NAME, "max_completion_tokens": 2}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(BadRequestError):
            client.chat.completions.create(**params)
    else:
        completion = client.chat.completions.create(**params)
        if prompt_logprobs is not None:
            assert _prompt_logprobs(completion) is not None
            assert len(_prompt_logprobs(completion)) > 0
        else:
            assert _prompt_logprobs(completion) is None


def test_more_than_one_prompt_logprobs_chat(client):
    params: dict = {"messages": PROMPT_LOGPROBS_MESSAGES, "model": MODEL_NAME, "max_completion_tokens": 2,
                    "extra_body": {"prompt_logprobs": 1}}
    completion_1 = client.chat.completions.create(**params)
    params["extra_body"] = {"prompt_logprobs": 2}
    completion_2 = client.chat.completions.create(**params)
    # the sampled prompt token may be among the top ones (then it is counted once), as in vLLM
    assert len(_prompt_logprobs(completion_1)[3]) in (1, 2)
    assert len(_prompt_logprobs(completion_2)[3]) in (2, 3)
    assert len(_prompt_logprobs(completion_2)[3]) == len(_prompt_logprobs(completion_1)[3]) + 1


def test_single_chat_session(client, server):
    messages = list(MESSAGES)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5, logprobs=True,
                                       top_logprobs=5, extra_body=NO_EOS)
    assert r.id is not None
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    # adaptation: zephyr's template gives 37 prompt tokens; here the server's /tokenize says how many, and
    # kvscope reports prompt_tokens_details (cached tokens) always, so the three counts are compared
    n_prompt = httpx.post(server.url_for("tokenize"), json={"model": MODEL_NAME, "messages": messages},
                          timeout=60).json()["count"]
    assert (r.usage.completion_tokens, r.usage.prompt_tokens, r.usage.total_tokens) == (5, n_prompt, n_prompt + 5)
    message = choice.message
    # adaptation: vLLM asserts len(content) >= 5 (zephyr's words); random tokens may decode to fewer characters
    assert message.content is not None and len(message.content) >= 1
    assert message.role == "assistant"
    messages.append({"role": "assistant", "content": message.content})
    # test multi-turn dialogue
    messages.append({"role": "user", "content": "express your result in json"})
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5)
    assert r.choices[0].message.content is not None


def test_chat_streaming(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10,
                                       temperature=0.0)
    output, stop_reason = r.choices[0].message.content, r.choices[0].finish_reason
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10,
                                                temperature=0.0, stream=True):
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            chunks.append(delta.content)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == stop_reason
    # adaptation: vLLM asserts the finishing chunk carries text; kvscope may send the finish_reason in a chunk
    # of its own (OpenAI does too), so the joined text is what must match
    assert "".join(chunks) == output


def test_chat_completion_stream_options(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0.0)
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": False}, **kw):
        assert chunk.usage is None

    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": False}, **kw)
    assert_usage_after_finish(stream)

    for opts in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(BadRequestError):
            client.chat.completions.create(stream=False, stream_options=opts, **kw)

    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True},
                                            extra_body=dict(min_tokens=10), **kw)
    last_completion_tokens = 0
    for chunk in stream:
        assert chunk.usage.prompt_tokens >= 0
        assert (last_completion_tokens == 0 or chunk.usage.completion_tokens > last_completion_tokens
                or (not chunk.choices and chunk.usage.completion_tokens == last_completion_tokens)
                # adaptation: kvscope's finishing chunk may carry no new token (finish_reason only)
                or (chunk.choices and chunk.choices[0].finish_reason is not None
                    and chunk.usage.completion_tokens == last_completion_tokens))
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        last_completion_tokens = chunk.usage.completion_tokens
    assert last_completion_tokens == 10
    # adaptation: vLLM's `min_characters` case is left out (kvscope has no such parameter)


def test_structured_outputs_choice_chat(client):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "The best language for type-safe systems programming is "}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=10,
                                       temperature=0.7, extra_body={"structured_outputs": {"choice": CHOICES}})
    choice1 = r.choices[0].message.content
    assert choice1 in CHOICES
    messages += [{"role": "assistant", "content": choice1}, {"role": "user", "content": "I disagree, pick another"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=10,
                                       temperature=0.7, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert r.choices[0].message.content in CHOICES
    # adaptation: vLLM also asserts the model picks a different one when told to: that is the model's text


def test_structured_outputs_json_chat(client):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": f"Give an example JSON that fits this schema: {JSON_SCHEMA}"}]
    # adaptation: max_completion_tokens 1000 -> 40 (the bounded schema closes well within it)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=40, seed=1,
                                       extra_body={"structured_outputs": {"json": JSON_SCHEMA}})
    jsonschema.validate(instance=json.loads(r.choices[0].message.content), schema=JSON_SCHEMA)
    # adaptation: vLLM's second turn asserts a different name and age: that is the model's text


def test_structured_outputs_regex_chat(client):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": f"Give an example IP address with this regex: {IP_REGEX}"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=20, seed=1,
                                       extra_body={"structured_outputs": {"regex": IP_REGEX}})
    ip1 = r.choices[0].message.content
    assert ip1 is not None and re.fullmatch(IP_REGEX, ip1) is not None
    # adaptation: vLLM's second turn asserts a different address: that is the model's text


def test_structured_outputs_type_error(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5,
                                       extra_body={"structured_outputs": {"regex": {1: "Python", 2: "C++"}}})


def test_structured_outputs_choice_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10, logprobs=True,
                                       top_logprobs=5, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    # -9999.0 is the minimum logprob returned by OpenAI
    for item in r.choices[0].logprobs.content[0].top_logprobs:
        assert item.logprob >= -9999.0


@pytest.mark.skip(reason="depends on the model's text: asserts the answer is {\"result\": 2}")
def test_response_format_json_object():
    pass


def test_response_format_json_schema(client):
    # adaptation: vLLM first checks zephyr does not answer {"result": 2} unprompted and then that it does with the
    # schema (the model's text); here the schema's shape is what is checked, with the integer bounded so a random
    # model closes it within max_completion_tokens
    schema = {"type": "object", "properties": {"result": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["result"],
              "additionalProperties": False}
    for seed in range(2):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": 'what is 1+1? The format is "result": 2'}],
            max_completion_tokens=20, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "foo_test", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_response_format_text(client):
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "what is 1+1?"}],
                                           max_completion_tokens=10, response_format={"type": "text"})
        assert r.choices[0].message.content is not None


def test_extra_fields_allowed(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
        temperature=0, seed=0, max_completion_tokens=5)       # adaptation: max_completion_tokens for speed
    assert r.choices[0].message.content is not None


@pytest.mark.skip(reason="depends on the model's text: asserts the answer is '2'")
def test_complex_message_content():
    pass


def test_complex_message_content_shape(client):
    # adaptation of test_complex_message_content: a list of text parts renders as the plain string does
    kw = dict(model=MODEL_NAME, temperature=0, seed=0, max_completion_tokens=5, extra_body={"return_token_ids": True})
    text = "what is 1+1? please provide the result without any other text."
    r1 = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
    r2 = client.chat.completions.create(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
                                        **kw)
    assert r1.usage.prompt_tokens == r2.usage.prompt_tokens
    assert r1.choices[0].message.content == r2.choices[0].message.content


def test_custom_role(client):
    # adaptation: kvscope rejects roles outside OpenAI's (400 naming `messages`); vLLM passes custom roles to the
    # template. What vLLM checks -- string and content-part forms are handled the same -- holds: both are 400
    errors = []
    for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]):
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "my-custom-role", "content": content}],
                                           temperature=0, seed=0, max_completion_tokens=5)
        errors.append(e.value.body.get("param"))
    assert errors == ["messages", "messages"]


def test_long_seed(client):
    for seed in [torch.iinfo(torch.long).min - 1, torch.iinfo(torch.long).max + 1]:
        with pytest.raises(BadRequestError) as exc_info:
            client.chat.completions.create(model=MODEL_NAME,
                                           messages=[{"role": "system", "content": "You are a helpful assistant."}],
                                           temperature=0, seed=seed, max_completion_tokens=5)
        # adaptation: vLLM matches pydantic's "greater_than_equal"/"less_than_equal"; kvscope's message names the
        # field and the limit
        assert "seed" in exc_info.value.message


def test_invocations(server, client):
    request_args = {"model": MODEL_NAME, "messages": MESSAGES, "max_completion_tokens": 5, "temperature": 0.0,
                    "logprobs": False}
    chat_output = client.chat.completions.create(**request_args).model_dump()
    invocation_response = httpx.post(server.url_for("invocations"), json=request_args, timeout=60)
    invocation_response.raise_for_status()
    invocation_output = invocation_response.json()
    # adaptation: the client's model_dump fills every field of its model with None; compare the keys the server
    # sent in both, and the choices as the server sent them
    assert set(invocation_output) <= set(chat_output)
    assert [{k: v for k, v in c.items() if v is not None} for c in invocation_output["choices"]] == \
        [json.loads(json.dumps(c, default=str)) and _strip(c) for c in chat_output["choices"]]


def _strip(d):
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if v is not None and v != []}
    return d


def test_chat_completion_n_parameter_non_streaming(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is the opposite of big?"}],
        max_completion_tokens=20, temperature=0.7, n=3, stream=False, extra_body=NO_EOS)   # adaptation: NO_EOS
    assert len(r.choices) == 3
    for i, choice in enumerate(r.choices):
        assert choice.index == i
        assert choice.message.content is not None and len(choice.message.content) > 0
    assert len({c.message.content for c in r.choices}) > 1


def test_chat_completion_n_parameter_streaming(client):
    chunks_by_index = defaultdict(list)
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_completion_tokens=15, temperature=0.7, n=2, stream=True, extra_body=NO_EOS):
        for choice in chunk.choices:
            if choice.delta.content:
                chunks_by_index[choice.index].append(choice.delta.content)
    assert len(chunks_by_index[0]) > 0 and len(chunks_by_index[1]) > 0
    assert "".join(chunks_by_index[0]) and "".join(chunks_by_index[1])


def test_chat_completion_n_with_seed(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}],
                                       max_completion_tokens=10, temperature=0.8, n=2, seed=42, stream=False,
                                       extra_body=NO_EOS)
    assert len(r.choices) == 2
    for i, choice in enumerate(r.choices):
        assert choice.index == i
        assert choice.message.content is not None and len(choice.message.content) > 0


def test_chat_completion_n_equals_1(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}],
                                       max_completion_tokens=10, temperature=0.7, n=1, stream=False)
    assert len(r.choices) == 1
    assert r.choices[0].index == 0
    assert r.choices[0].message.content is not None
