"""Tool calling through the OpenAI server with the official client: `required` and a named function are enforced
(the arguments validate against the function's schema, streamed or not), tool messages are rendered back into
the prompt, `auto` on the bundled model answers a plain question with text; the tool parsers on their own."""
import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from engine import EngineConfig
from engine.entrypoints.openai.api_server import ServerThread, build_app
from engine.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from engine.runtime.async_engine import EngineLoop

MODEL = "dummy:tiny"
# bounded values: the random-weight model ends them (a free string may run past max_tokens)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["unit", "days"],
                                                     "properties": {"unit": {"enum": ["c", "f"]},
                                                                    "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["ok"],
        "properties": {"ok": {"type": "boolean"}}}}},
]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def srv():
    loop = EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=128, max_model_len=1024,
                                   max_num_seqs=8)).start()
    with ServerThread(build_app(loop)) as s:
        s.client = OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=120)
        s.loop = loop
        yield s
    loop.shutdown()


def _valid(name, args):
    jsonschema.validate(json.loads(args), SCHEMA[name])
    return True


def _streamed_calls(stream):
    calls, finish, first = {}, None, None
    for ch in stream:
        d = ch.choices[0].delta
        if first is None:
            first = d
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or tc.id
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, first


def test_named_function_enforced_streamed_and_not(srv):
    tc = {"type": "function", "function": {"name": "get_weather"}}
    r = srv.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tc, n=4, seed=7,
                                           temperature=1.0, max_tokens=40)
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_") and c.message.content is None
        assert _valid("get_weather", call.function.arguments) and c.finish_reason == "stop"
    calls, finish, first = _streamed_calls(srv.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tc, seed=7, temperature=1.0, max_tokens=40, stream=True))
    assert first.role == "assistant" and not first.content and not first.tool_calls     # the role alone
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and finish == "stop"
    assert calls[0]["arguments"] == r.choices[0].message.tool_calls[0].function.arguments   # same seed


def test_required_enforced_parallel_or_not(srv):
    for parallel in (False, None):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = srv.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               n=4, seed=3, temperature=1.0, max_tokens=80, **kw)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
            assert all(_valid(t.function.name, t.function.arguments) for t in c.message.tool_calls)
            if parallel is False:
                assert len(c.message.tool_calls) == 1
    calls, finish, _ = _streamed_calls(srv.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=3, temperature=1.0, max_tokens=80,
        stream=True))
    whole = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls] == whole and finish == "tool_calls"


def test_tool_history_rendered_into_the_prompt(srv):
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"unit": "c", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 1,
                                                            "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    prompt = r.json()["choices"][0]["prompt_token_ids"]
    assert prompt == r.json()["prompt_token_ids"]
    text = srv.loop.engine.tokenizer.decode(prompt)      # SmolLM2's template renders no tools: a system prompt does
    assert "<tools>" in text and '"name": "ping"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "auto"}, "tool_choice"),                                   # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": 3}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
])
def test_tool_request_errors_400(srv, body, param):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------------- parsers
HERMES_OUT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 3}}\n</tool_call>'
              '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
LLAMA_OUT = '<|python_tag|>{"name": "get_weather", "parameters": {"unit": "f", "days": 1}}; {"name": "ping", "parameters": {}}'


@pytest.mark.parametrize("parser, text, content", [(HermesToolParser(), HERMES_OUT, "Let me check."),
                                                   (Llama3JsonToolParser(), LLAMA_OUT, None)])
def test_parsers_whole_and_streamed_agree(parser, text, content):
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"unit": "c" if parser.name == "hermes" else "f", "days": 3 if parser.name == "hermes" else 1}),
        ("ping", {})]
    for step in (1, 3, 7):                       # any split of the text into deltas gives the same calls
        st, sent, streamed = parser.streaming(), "", []
        for i in range(0, len(text), step):
            c, k = st.feed(text[i:i + step])
            sent, streamed = sent + c, streamed + k
        c, k = st.finish()
        sent, streamed = sent + c, streamed + k
        assert streamed == calls and "<tool_call>" not in sent and sent.strip() == (content or "")


def test_parsers_leave_plain_text_alone():
    for p in (HermesToolParser(), Llama3JsonToolParser()):
        assert p.extract("Hello <tool there") == ("Hello <tool there", [])
        st = p.streaming()
        out = "".join(st.feed(ch)[0] for ch in "Hello <tool there") + st.finish()[0]
        assert out == "Hello <tool there"
    assert HermesToolParser().extract("<tool_call>not json</tool_call>")[1] == []


@pytest.mark.slow
def test_auto_on_the_bundled_model_answers_text_when_no_tool_is_needed():
    loop = EngineLoop(EngineConfig(device="cpu", max_model_len=1024, max_num_seqs=4)).start()
    try:
        with ServerThread(build_app(loop)) as s:
            c = OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=300)
            model = c.models.list().data[0].id
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          tools=TOOLS, temperature=0, max_tokens=16)
            m = r.choices[0].message
            assert not m.tool_calls and m.content and r.choices[0].finish_reason in ("stop", "length")
            tc = {"type": "function", "function": {"name": "get_weather"}}
            r = c.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=tc, seed=0,
                                          temperature=1.0, max_tokens=40)
            assert _valid("get_weather", r.choices[0].message.tool_calls[0].function.arguments)
    finally:
        loop.shutdown()


# A Qwen-2.5-style template that renders tools itself (trimmed): tools in the system turn, calls as JSON objects.
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_natively(srv):
    import copy
    from types import SimpleNamespace

    from engine.entrypoints.openai.protocol import ChatCompletionRequest
    from engine.entrypoints.openai.tools import render_chat
    from engine.entrypoints.openai.tool_parsers import tool_parser_for

    tok = copy.deepcopy(srv.loop.engine.tokenizer)
    tok.chat_template = NATIVE_TEMPLATE
    eng = SimpleNamespace(tokenizer=tok, apply_chat_template=lambda msgs, agp, tools, cfm: tok.apply_chat_template(
        msgs, tools=tools, tokenize=False, add_generation_prompt=agp, continue_final_message=cfm))
    req = ChatCompletionRequest.model_validate({"messages": ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "ping", "arguments": "{\"ok\": true}"}}]}, {"role": "tool", "content": "pong"}], "tools": TOOLS})
    parser = tool_parser_for(None, tok.chat_template)
    text = render_chat(eng, req.messages, req.tools, req.tool_choice_mode(), parser)
    assert parser.name == "hermes" and "function calling AI model" not in text      # no injected prompt
    assert json.dumps(req.tools[0]) in text.replace("\n", "")
    assert '{"name": "ping", "arguments": {"ok": true}}' in text                     # arguments as an object
    assert "<tool_response>\npong\n</tool_response>" in text
    assert tool_parser_for(None, "{{ '<|start_header_id|>' }}").name == "llama3_json"
