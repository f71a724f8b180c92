"""GPU-only: structured output with CUDA graphs, Triton kernels, the fused sampler and multi-step decoding
(skipped without CUDA or without SmolLM2's tokenizer for the random-weight preset; see the README)."""
import json
import re

import pytest
import torch

from engine import LLMEngine, SamplingParams
from helpers import drain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3}}}


def satisfies(v) -> bool:
    """SCHEMA checked by hand (the GPU box may have no jsonschema)."""
    return (isinstance(v, dict) and set(v) == {"name", "age", "tags"}
            and isinstance(v["name"], str) and re.fullmatch("[a-z]{1,6}", v["name"]) is not None
            and type(v["age"]) is int and 0 <= v["age"] <= 120
            and isinstance(v["tags"], list) and len(v["tags"]) <= 3 and all(t in ("x", "y", "z") for t in v["tags"]))


@pytest.fixture(scope="module")
def eng():
    e = LLMEngine(model="dummy:llama-3.2-1b", device="cuda", max_model_len=512, max_num_seqs=64)
    if e.tokenizer is None:
        pytest.skip("no tokenizer for the random-weight preset (copy SmolLM2's tokenizer files, README)")
    return e


def test_constrained_and_free_rows_on_gpu(eng, monkeypatch):
    """Valid JSON from every constrained row while free rows (and multi-step blocks before and after) run, in
    pipelined grammar blocks with the fused mask kernel; token identity of the free rows and of the pipeline
    against synced steps is checked on CPU (bf16 GPU kernels are not batch-size invariant)."""
    from engine.worker.multi_step import MultiStepDecoder
    blocks = []
    inner = MultiStepDecoder._sample_grammar_block
    monkeypatch.setattr(MultiStepDecoder, "_sample_grammar_block", lambda s, b: blocks.append(b.K) or inner(s, b))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 40, 13, 90)]
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [eng.add_request(p, free) for p in prompts]
    cons = [eng.add_request(p, SamplingParams(temperature=1.0, seed=s, max_tokens=64,
                                              structured_outputs={"json": SCHEMA}))
            for s, p in enumerate(prompts * 8)]
    outs = drain(eng)
    assert all(len(outs[i].token_ids) == 40 for i in ids)
    for i in cons:
        assert outs[i].finish_reason == "stop", outs[i].text
        assert satisfies(json.loads(outs[i].text)), outs[i].text
    assert eng.structured.num_constrained == 0 and eng.block_manager.num_free_blocks == eng.num_blocks - 1
    assert eng.structured_overlap and sum(blocks) >= 10 and max(blocks) > 1 and eng.structured.bitmask.fused

