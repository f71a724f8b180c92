"""Pipelined constrained decoding (EngineConfig.structured_overlap) on the bundled SmolLM2: the same tokens as
one synced step per token, for constrained and free requests in one batch, greedy, seeded and unseeded,
through multi-step blocks, preemption, late arrivals and aborts; no mask work at all without constraints."""
import json

import jsonschema
import pytest
from helpers import drain

from engine import EngineConfig, SamplingParams, StructuredOutputsParams
from engine.worker.multi_step import MultiStepDecoder

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["c", "p"],
          "properties": {"c": {"enum": ["red", "green", "blue"]}, "p": {"type": "integer", "minimum": 0,
                                                                         "maximum": 999}}}
JSON = StructuredOutputsParams(json=SCHEMA)
PROMPT = "Reply with a JSON object."


@pytest.fixture
def grammar_blocks(monkeypatch):
    """The grammar blocks masked and sampled: (batch, iterations) each (a spy around
    MultiStepDecoder._sample_grammar_block)."""
    calls = []
    inner = MultiStepDecoder._sample_grammar_block

    def spy(self, blk):
        calls.append((len(blk.sched.seqs), blk.K))
        return inner(self, blk)
    monkeypatch.setattr(MultiStepDecoder, "_sample_grammar_block", spy)
    return calls


def run(eng, reqs, arrivals=None):
    """Step until done; `arrivals` {step: [(prompt, params)]} adds requests before that step. Outputs in order."""
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    outs, step = {}, 0
    while eng.has_unfinished_requests() or (arrivals and any(s >= step for s in arrivals)):
        for p, sp in (arrivals or {}).get(step, []):
            ids.append(eng.add_request(p, sp))
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        step += 1
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1 and eng.structured.num_constrained == 0
    return [outs[i] for i in ids]


def same(a, b):
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in a] == \
        [(o.token_ids, o.finish_reason, o.stop_reason) for o in b]


def mixed(eng):
    chat = lambda c: eng.apply_chat_template([{"role": "user", "content": c}])   # noqa: E731
    return [
        (PROMPT, SamplingParams(temperature=0, max_tokens=24, structured_outputs=JSON)),
        (PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured_outputs=JSON)),
        (PROMPT, SamplingParams(temperature=1.0, max_tokens=24, structured_outputs=JSON)),            # unseeded
        ("Pick one:", SamplingParams(temperature=1.0, max_tokens=8, structured_outputs={"choice": ["alpha", "beta gamma"]})),
        ("Code:", SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=12,
                                 structured_outputs={"regex": r"[a-z]{2,5}-[0-9]{1,6}"})),
        (chat("Count from one to ten in words."), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        (chat("Write one sentence about cats."), SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)),
        (chat("Name three colours."), SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=16,
                                                     repetition_penalty=1.3, min_tokens=10)),
    ]


def test_overlap_gives_the_tokens_of_synced_steps(smollm2_engine_factory, grammar_blocks):
    off = smollm2_engine_factory(structured_overlap=False)
    reference = run(off, mixed(off))
    assert not grammar_blocks
    on = smollm2_engine_factory(structured_overlap=True)
    outs = run(on, mixed(on))
    same(outs, reference)
    assert len(grammar_blocks) >= 8 and max(grammar_blocks) == (8, 1)  # the whole batch, one token a block
    for o in outs[:3]:
        assert o.finish_reason == "stop"                # grammar complete: stopped at the same token
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert outs[3].text in ("alpha", "beta gamma")


def test_overlap_with_multistep_preemption_and_arrivals(smollm2_engine_factory, grammar_blocks):
    """A tight KV pool forces preemptions (normal steps), plain multi-step blocks run before the constrained
    requests arrive and after they end, and requests arrive while grammar blocks are in flight."""
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    free = [("Name three colours of the rainbow.", greedy), ("Write one sentence about dogs.", seeded)]
    arrivals = {6: [(PROMPT, SamplingParams(temperature=1.0, seed=s, max_tokens=32, structured_outputs=JSON))
                    for s in range(3)],
                14: [("Count to five:", greedy), (PROMPT, SamplingParams(temperature=0, max_tokens=32,
                                                                        structured_outputs=JSON))]}
    cfg = dict(num_kv_blocks=8, enable_prefix_caching=False, num_scheduler_steps=4)
    off = smollm2_engine_factory(structured_overlap=False, **cfg)
    reference = run(off, free, arrivals)
    on = smollm2_engine_factory(structured_overlap=True, **cfg)
    outs = run(on, free, arrivals)
    assert on.scheduler.num_preemptions > 0 and grammar_blocks
    same(outs, reference)
    for o in outs[2:5] + outs[6:]:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_grammar_blocks_of_several_iterations(smollm2_engine_factory, grammar_blocks):
    """With num_scheduler_steps=4 a grammar block runs 4 iterations, the host feeding each token to the
    grammars inside it: the same tokens as synced steps, for grammars that end mid-block (the choice, the
    regex) and free requests; a request with a penalty in the batch makes the blocks one iteration long."""
    seeded = lambda s, n, **kw: SamplingParams(temperature=1.0, seed=s, max_tokens=n, **kw)   # noqa: E731
    reqs = [(PROMPT, SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON)),
            (PROMPT, seeded(1, 40, structured_outputs=JSON)),
            ("Pick one:", seeded(2, 8, structured_outputs={"choice": ["alpha", "beta gamma"]})),
            ("Code:", SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=12,
                                     structured_outputs={"regex": r"[a-z]{2,5}-[0-9]{1,6}"})),
            ("Count to ten:", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
            ("Say hi.", seeded(4, 9, ignore_eos=True, min_tokens=5)),
            ("Colours:", seeded(6, 6, ignore_eos=True, repetition_penalty=1.3))]
    off = smollm2_engine_factory(structured_overlap=False, num_scheduler_steps=4)
    reference = run(off, reqs)
    on = smollm2_engine_factory(structured_overlap=True, num_scheduler_steps=4)
    outs = run(on, reqs)
    same(outs, reference)
    assert {K for _, K in grammar_blocks} == {1, 4}
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert outs[2].text in ("alpha", "beta gamma") and outs[2].finish_reason == "stop"
    grammar_blocks.clear()
    one = smollm2_engine_factory(structured_overlap=True, num_scheduler_steps=4, structured_multi_step=False,
                                 structured_mask_threads=1)
    same(run(one, reqs), reference)
    assert {K for _, K in grammar_blocks} == {1}


def test_abort_while_a_grammar_block_is_in_flight(smollm2_engine_factory, grammar_blocks):
    eng = smollm2_engine_factory(structured_overlap=True)
    free = (PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    reference = run(eng, [free])[0].token_ids
    ids = [eng.add_request(*free)] + [eng.add_request(PROMPT, SamplingParams(
        temperature=1.0, seed=s, max_tokens=24, structured_outputs=JSON)) for s in range(2)]
    n = 0
    while len(grammar_blocks) < 3:
        eng.step()
        n += 1
        assert n < 20
    assert eng.abort_request(ids[1]).finish_reason == "abort"       # its next token is on its way
    outs = drain(eng)
    assert outs[ids[0]].token_ids == reference
    jsonschema.validate(json.loads(outs[ids[2]].text), SCHEMA)
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1 and eng.structured.num_constrained == 0


def test_logprobs_requests_take_synced_steps(smollm2_engine_factory, grammar_blocks):
    eng = smollm2_engine_factory(structured_overlap=True)
    out = run(eng, [(PROMPT, SamplingParams(temperature=0, max_tokens=24, logprobs=2, structured_outputs=JSON))])[0]
    assert not grammar_blocks and len(out.logprobs) == len(out.token_ids)
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_no_constraint_no_mask_work(smollm2_engine_factory, grammar_blocks):
    eng = smollm2_engine_factory(structured_overlap=True, num_scheduler_steps=4)
    run(eng, [(PROMPT, SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)) for _ in range(3)])
    assert eng.structured.bitmask is None and not grammar_blocks


@pytest.mark.parametrize("field,value", [("structured_overlap", "yes"), ("fused_token_bitmask", None),
                                         ("structured_multi_step", 1), ("structured_mask_threads", 0),

                                         ("structured_mask_threads", True)])
def test_switches_are_validated(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}:"):
        EngineConfig(**{field: value})


def test_inspector_sees_mask_time_of_pipelined_steps(smollm2_engine_factory, grammar_blocks):
    from inspector.recorder import Recorder
    eng = smollm2_engine_factory(structured_overlap=True)
    rec = Recorder().attach(eng.events)
    try:
        out = run(eng, [(PROMPT, SamplingParams(temperature=0, max_tokens=24, structured_outputs=JSON)),
                        (PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))])[0]
        snap = rec.snapshot()
    finally:
        rec.detach()
    masked = [s for s in snap.steps if "grammar mask" in s.timings]
    assert grammar_blocks and all(s.timings["grammar mask"] > 0 for s in masked)
    # every token it sampled was masked in some step; the first pipelined step masks two (its block's and the
    # next one's)
    assert len(masked) >= len(out.token_ids) - 1

