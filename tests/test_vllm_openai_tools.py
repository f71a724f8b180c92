"""Ported from vLLM's tests/entrypoints/openai/chat_completion/test_tool_choice_null.py (there on the request
model, here over HTTP) and the model-agnostic shapes of chat_completion/test_completion_with_function_calling.py
(`required` / named tool_choice: calls that parse and validate, streamed the same as not).

Adaptations, common to every test (each test notes its own):
- vLLM's ChatCompletionRequest.model_validate -> a request to kvscope's server (`dummy:tiny`, random weights):
  a pydantic ValidationError there is a 400 here; "tool_choice == 'auto'" is observed as a tools-rendering,
  unconstrained request.
- vLLM's Qwen3 + hermes parser and weather tools -> tools with bounded parameters (an enum, a bounded integer),
  so a random model closes a call within max_tokens; the model's choice of call (the text) is not asserted.
"""
import json

import httpx
import jsonschema
import pytest

import vllm_openai_server
from vllm_openai_server import MODEL_NAME

server, client = vllm_openai_server.server, vllm_openai_server.client   # fixtures: one server for this file

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["unit", "days"],
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _post(server, body):
    return httpx.post(server.url_for("v1/chat/completions"), json={"max_tokens": 4, **body}, timeout=120)


# ------------------------------------------------------------------------------ test_tool_choice_null.py
def test_null_tool_choice_defaults_to_auto_like_an_absent_one(server):
    omitted = _post(server, {"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "return_token_ids": True})
    explicit_null = _post(server, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": None, "temperature": 0,
                                   "return_token_ids": True})
    assert omitted.status_code == explicit_null.status_code == 200, explicit_null.text
    # adaptation: both render the tools into the same prompt and generate the same (unconstrained) output
    assert omitted.json()["prompt_token_ids"] == explicit_null.json()["prompt_token_ids"]
    assert omitted.json()["choices"][0]["token_ids"] == explicit_null.json()["choices"][0]["token_ids"]


def test_null_tool_choice_without_tools_matches_an_absent_one(server):
    omitted = _post(server, {"messages": MESSAGES, "return_token_ids": True})
    explicit_null = _post(server, {"messages": MESSAGES, "tool_choice": None, "return_token_ids": True})
    assert omitted.status_code == explicit_null.status_code == 200, explicit_null.text
    assert omitted.json()["prompt_token_ids"] == explicit_null.json()["prompt_token_ids"]


def test_null_tool_choice_does_not_conflict_with_structured_outputs(server):
    r = _post(server, {"messages": MESSAGES, "structured_outputs": {"json": {"type": "object"}}, "tool_choice": None,
                       "max_tokens": 4})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("tool_choice,tools", [("bogus", TOOLS), ("auto", None)])
def test_invalid_tool_choice_is_still_rejected(server, tool_choice, tools):
    payload = {"messages": MESSAGES, "tool_choice": tool_choice}
    if tools is not None:
        payload["tools"] = tools
    r = _post(server, payload)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_explicit_none_tool_choice_is_untouched(server):
    # adaptation: "none" is observed as a prompt without the tools and a plain text answer
    r = _post(server, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "return_token_ids": True})
    plain = _post(server, {"messages": MESSAGES, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == plain.json()["prompt_token_ids"]
    assert not r.json()["choices"][0]["message"].get("tool_calls")


# ------------------------------------------------------------------------------ test_completion_with_function_calling.py
def _stream_calls(stream):
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(tc.index, ["", ""])
            c[0] += tc.function.name or ""
            c[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(c) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_function_tool_use(client, tool_choice):
    # adaptation: vLLM checks the call's name and city against Qwen3's answer; here every call validates against
    # its function's schema, and streamed and whole agree for one seed (max_tokens 60 bounds the random model)
    kw = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=5,
              max_completion_tokens=60, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    assert len(calls) == 1 and r.choices[0].message.content is None
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMA[name])
    if isinstance(tool_choice, dict):
        assert calls[0][0] == "get_weather" and r.choices[0].finish_reason == "stop"
    else:
        assert r.choices[0].finish_reason == "tool_calls"
    streamed, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
    assert streamed == calls and finish == r.choices[0].finish_reason


def test_required_closes_undeclared_properties(client):
    # not in vLLM's file: with xgrammar's strict mode (vLLM's default) a function's arguments hold only its
    # declared parameters; get_time declares none, so its arguments are always {}
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS[1:], tool_choice="required",
                                       temperature=1.0, seed=0, n=4, max_completion_tokens=40)
    for c in r.choices:
        assert [json.loads(t.function.arguments) for t in c.message.tool_calls][0] == {}
