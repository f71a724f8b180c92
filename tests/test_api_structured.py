"""Structured output through the OpenAI server with the official client: response_format json_object /
json_schema on chat and completions, the regex / choice extensions, and 400s naming the bad parameter."""
import json
import marshal
import re
from dataclasses import asdict

import jsonschema
import openai
import pytest
from openai import OpenAI

from engine import EngineConfig, SamplingParams
from engine.runtime.async_engine import EngineLoop
from engine.entrypoints.openai.api_server import ServerThread, build_app
from helpers import json_prefix_kind

MODEL = "dummy:tiny"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population", "tags"],
          "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "maxItems": 2}}}


@pytest.fixture(scope="module")
def client():
    loop = EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=128, max_model_len=512,
                                   max_num_seqs=8)).start()
    with ServerThread(build_app(loop)) as srv:
        yield OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    loop.shutdown()


def test_chat_json_schema_and_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a city as JSON."}], max_tokens=60, n=4,
        seed=5, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    # the random-weight model rarely closes a string: a choice that runs out of tokens must still be the start of
    # a JSON object, one that stops must parse as one (the seeds give both)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                       max_tokens=40, n=4, seed=1, temperature=1.0,
                                       response_format={"type": "json_object"})
    kinds = []
    for c in r.choices:
        text = c.message.content
        assert text.startswith("{")
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(text), {"type": "object"})
        else:
            assert c.finish_reason == "length" and json_prefix_kind(text) == "prefix", text
        kinds.append(c.finish_reason)
    assert "stop" in kinds, [c.message.content for c in r.choices]


def test_completions_json_schema_regex_choice(client):
    r = client.completions.create(model=MODEL, prompt="City:", max_tokens=60, temperature=1.0, seed=2,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "c", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="Date:", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yes or no?"}],
                                       max_tokens=8, n=3, temperature=1.0, extra_body={"choice": ["yes", "no"]})
    assert all(c.message.content in ("yes", "no") for c in r.choices)


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"regex": "(unclosed"}, "regex", "unclosed group"),
    ({"choice": []}, "choice", "non-empty"),
    ({"regex": "a", "choice": ["a"]}, "regex", "at most one"),
])
def test_invalid_constraints_are_400s_naming_the_parameter(client, body, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=body)
    err = e.value.body
    assert err["param"] == param and needle in err["message"], err
    ok = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


def test_params_cross_the_engine_process_boundary():
    """EngineCoreClient sends asdict(params) through marshal; the constraint must come back whole."""
    sp = SamplingParams(max_tokens=8, structured_outputs={"json": SCHEMA})
    back = SamplingParams(**marshal.loads(marshal.dumps(asdict(sp))))
    assert back.structured_outputs == sp.structured_outputs and back.structured_outputs.key() == sp.structured_outputs.key()
