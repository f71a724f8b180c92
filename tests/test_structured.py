"""Structured output on the bundled SmolLM2: sampled generations always satisfy their JSON schema / regex /
choice; constraints leave unconstrained requests in the same batch untouched (preemption, multi-step,
speculative decoding); invalid constraints are clear errors and the engine keeps serving."""
import json
import re

import jsonschema
import pytest
from helpers import drain

from engine import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

# Compact keys and bounded values keep every valid object under ~25 tokens, so ~100 sampled generations stay
# cheap on a CPU (an unbounded "number" could grow fraction digits forever: multipleOf bounds them).
SCHEMAS = {
    "nested": {
        "type": "object", "additionalProperties": False, "required": ["u", "ok"],
        "properties": {
            "u": {"type": "object", "additionalProperties": False, "required": ["n", "a"],
                  "properties": {
                      "n": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                      "a": {"type": "object", "additionalProperties": False, "required": ["c"],
                            "properties": {"c": {"enum": ["Paris", "Lyon", "Nice"]}}}}},
            "ok": {"type": "boolean"}}},
    "array": {
        "type": "object", "additionalProperties": False, "required": ["s"],
        "properties": {"s": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                             "minItems": 1, "maxItems": 3}}},
    "enum": {
        "type": "object", "additionalProperties": False, "required": ["c", "p"],
        "properties": {"c": {"enum": ["red", "green", "blue"]}, "p": {"enum": [1, 2, 3]}}},
    "bounds": {
        "type": "object", "additionalProperties": False, "required": ["a", "t", "k"],
        "properties": {"a": {"type": "integer", "minimum": 18, "maximum": 99},
                       "t": {"type": "number", "minimum": -10, "maximum": 40, "multipleOf": 0.25},
                       "k": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}}},
}
N_PER_SCHEMA = 24
PROMPT = "Reply with a JSON object."


@pytest.fixture(scope="module")
def eng(smollm2_engine_factory):
    return smollm2_engine_factory()


def run(eng, reqs):
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    outs = drain(eng)
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
    assert eng.structured.num_constrained == 0
    return [outs[i] for i in ids]


def json_params(schema, seed, max_tokens=32):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=schema))


# ---- outputs satisfy their constraint -----------------------------------------------------------------
def test_sampled_json_always_validates(eng):
    reqs = [(PROMPT, json_params(schema, seed)) for schema in SCHEMAS.values() for seed in range(N_PER_SCHEMA)]
    outs = run(eng, reqs)
    for (name, schema), i in zip(SCHEMAS.items(), range(0, len(outs), N_PER_SCHEMA)):
        texts = [o.text for o in outs[i:i + N_PER_SCHEMA]]
        for o in outs[i:i + N_PER_SCHEMA]:
            assert o.finish_reason == "stop", (name, o.text)
            jsonschema.validate(json.loads(o.text), schema)
        assert len(set(texts)) > 1, name            # sampled, not one forced string


def test_regex_and_choice(eng):
    rx = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["positive", "negative", "neutral"]
    reqs = [("Write a code:", SamplingParams(temperature=1.0, seed=s, max_tokens=16,
                                             structured_outputs={"regex": rx})) for s in range(10)]
    reqs += [("Sentiment of 'great movie':", SamplingParams(temperature=1.0, seed=s, max_tokens=8,
                                                            structured_outputs={"choice": choices}))
             for s in range(10)]
    outs = run(eng, reqs)
    for o in outs[:10]:
        assert re.fullmatch(rx, o.text), o.text
    for o in outs[10:]:
        assert o.text in choices and o.finish_reason == "stop"


def test_grammar_and_json_object(eng):
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'
    # asked as a chat, the model closes its (greedy, ~40-token) object well before max_tokens
    chat = eng.apply_chat_template([{"role": "user", "content": "Reply with a small JSON object with one key."}])
    outs = run(eng, [("Sum:", SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                             structured_outputs={"grammar": lark})),
                     (chat, SamplingParams(temperature=0, max_tokens=64,
                                           structured_outputs={"json_object": True}))])
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", outs[0].text), outs[0].text
    assert outs[1].finish_reason == "stop", outs[1].text
    obj = json.loads(outs[1].text)
    jsonschema.validate(obj, {"type": "object"})
    assert obj                                       # an object with keys, not just "{}"


# ---- constraints do not disturb anyone else ------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
FREE = ["Name three colours of the rainbow.", "Count from one to ten in words.", "Write one sentence about cats."]


def test_unconstrained_rows_identical_with_preemption_and_multistep(smollm2_engine_factory, eng):
    free = [(eng.apply_chat_template([{"role": "user", "content": c}]), sp)
            for c, sp in zip(FREE, [GREEDY, SEEDED, GREEDY])]
    reference = [o.token_ids for o in run(eng, free)]
    constrained = [(PROMPT, json_params(SCHEMAS["nested"], s)) for s in range(3)]
    # 6 requests of 30-50 tokens need ~14 blocks of 16: 8 force preemptions (recompute); multi-step is on
    small = smollm2_engine_factory(num_kv_blocks=8, enable_prefix_caching=False, num_scheduler_steps=4)
    # the constrained requests are admitted last, so they are the first victims (most recently admitted)
    outs = run(small, free + constrained)
    assert small.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions for o in outs[3:])     # a constrained request was recomputed
    assert [o.token_ids for o in outs[:3]] == reference
    for o in outs[3:]:
        jsonschema.validate(json.loads(o.text), SCHEMAS["nested"])
    alone = run(eng, constrained)                  # the grammar state survived preemption exactly
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs[3:]]


def test_speculative_decoding_skips_constrained_rows(smollm2_engine_factory, eng):
    # the reply repeats the prompt, so the n-gram drafter finds matches to draft from
    free = (eng.apply_chat_template([{"role": "user", "content": "Repeat exactly: one two three four five, "
                                                                 "one two three four five."}]), GREEDY)
    reference = run(eng, [free])[0].token_ids
    spec = smollm2_engine_factory(speculative_method="ngram", num_speculative_tokens=3)
    ids = [spec.add_request(*free), spec.add_request(PROMPT, json_params(SCHEMAS["enum"], 1))]
    outs = drain(spec)
    assert outs[ids[0]].token_ids == reference
    jsonschema.validate(json.loads(outs[ids[1]].text), SCHEMAS["enum"])
    assert spec.drafter.request_stats(ids[1]) is None          # never drafted for
    assert spec.drafter.request_stats(ids[0])["num_draft_tokens"] > 0


# ---- bad constraints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("so,field,needle", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "structured_outputs.json", "strin"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar", "undefined_rule"),
])
def test_invalid_constraint_is_a_clear_error_and_engine_keeps_serving(eng, so, field, needle):
    with pytest.raises(ValueError) as e:
        eng.add_request(PROMPT, SamplingParams(max_tokens=4, structured_outputs=so))
    assert str(e.value).startswith(field + ":") and needle in str(e.value)
    out = run(eng, [(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])[0]
    assert len(out.token_ids) == 4 and not eng.seqs


def test_compiled_once_per_constraint(eng):
    before = eng.structured.compiler.num_compiled
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    run(eng, [(PROMPT, json_params(schema, s, 16)) for s in range(4)])
    run(eng, [(PROMPT, json_params(json.loads(json.dumps(schema)), 9, 16))])
    assert eng.structured.compiler.num_compiled == before + 1


# ---- the inspector sees it --------------------------------------------------------------------------------
def test_inspector_shows_mask_time_and_constrained_requests(eng):
    from inspector import figures as F
    from inspector.recorder import Recorder
    rec = Recorder().attach(eng.events)
    try:
        ids = [eng.add_request(PROMPT, json_params(SCHEMAS["enum"], 0)),
               eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))]
        drain(eng)
        snap = rec.snapshot()
    finally:
        rec.detach()
    tracks = {r.request_id: r for r in snap.requests}
    assert tracks[ids[0]].structured == "json" and tracks[ids[1]].structured is None
    masked = [s for s in snap.steps if "grammar mask" in s.timings]
    assert masked and all(s.timings["grammar mask"] > 0 for s in masked)
    assert len(masked) >= tracks[ids[0]].output_len > 0     # every token it sampled was masked in its step
    spec = F.timings_spec(snap)
    assert "grammar mask" in {t.get("name") for t in spec["data"]}
    hover = " ".join(str(h) for t in F.timeline_spec(snap)["data"] for h in (t.get("hovertext") or []))
    assert f"{ids[0]} · " in hover and "constrained (json)" in hover
