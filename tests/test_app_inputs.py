"""app.py input handling without a server: every bad UI input gets a clear message naming the field."""
import math

import pytest

import app as A
from engine.config import EngineConfig
from inspector import load as L
from webui import forms

SAMPLING_OK = dict(temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, max_tokens=32, min_tokens=0,
                   repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None, stop="",
                   ignore_eos=False, logprobs_on=False, logprobs_n=3)


def sp(**kw):
    d = dict(SAMPLING_OK)
    d.update(kw)
    return forms.make_sampling_params(*d.values(), max_model_len=2048)


def test_sampling_params_parsed():
    p = sp(stop="###\nEND", seed=7, logprobs_on=True, logprobs_n=2, top_k=-1)
    assert p.stop == ["###", "END"] and p.seed == 7 and p.logprobs == 2 and p.top_k == 0
    assert sp().seed is None and sp().logprobs is None
    # the playground's seed box is text: empty = random (None), "0" is a real seed
    assert sp(seed="").seed is None and sp(seed=" 42 ").seed == 42 and sp(seed="0").seed == 0
    with pytest.raises(ValueError, match="seed"):
        sp(seed="abc")


def test_structured_output_box():
    assert sp().structured_outputs is None
    p = sp(structured_kind="JSON schema", structured_text='{"type": "object"}')
    assert p.structured_outputs.json == {"type": "object"}
    assert sp(structured_kind="choice", structured_text="yes\n\nno\n").structured_outputs.choice == ["yes", "no"]
    assert sp(structured_kind="regex", structured_text=r"\d+").structured_outputs.regex == r"\d+"
    assert sp(structured_kind="JSON object").structured_outputs.json_object is True
    with pytest.raises(ValueError, match="JSON schema is not valid JSON"):
        sp(structured_kind="JSON schema", structured_text="{oops")
    with pytest.raises(ValueError, match="enter the regex"):
        sp(structured_kind="regex", structured_text="  ")


@pytest.mark.parametrize("kw,word", [
    (dict(max_tokens=10**9), "max tokens"), (dict(max_tokens=0), "max tokens"), (dict(max_tokens=2.5), "whole"),
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top-p"), (dict(top_k=-5), "top-k"),
    (dict(min_tokens=99), "min tokens"), (dict(seed=-3), "seed"), (dict(max_tokens=None), "max tokens"),
    (dict(repetition_penalty=0), "repetition penalty"), (dict(presence_penalty=3), "presence penalty"),
    (dict(max_tokens="abc"), "number"),
    # values the sampler cannot compute (a step would raise): refused with the engine's limit
    (dict(repetition_penalty=1e-300), r"repetition penalty: must be >= 1e-06"),
    (dict(top_k=1e30), r"top_k: .*2\*\*63"),
])
def test_sampling_params_messages(kw, word):
    with pytest.raises(ValueError, match=word):
        sp(**kw)


LOAD_OK = dict(preset="custom", n=8, rate=4.0, all_at_once=False, burstiness=1.0, conc=0, p_kind="uniform", p_min=8,
               p_max=16, o_kind="fixed", o_min=4, o_max=4, shared=0, turns=1, think=0.0, seed=0, temp=0.0, ieos=True)


def ls(**kw):
    d = dict(LOAD_OK)
    d.update(kw)
    return forms.make_load_spec(*d.values(), max_model_len=512)


def test_load_spec_parsed():
    s = ls(all_at_once=True, conc=4)
    assert math.isinf(s.rate) and s.max_concurrency == 4 and s.output_len == L.LengthDist("fixed", 4, 4)
    assert ls().max_concurrency is None


@pytest.mark.parametrize("kw,word", [
    (dict(rate=0), "rate"), (dict(rate=-1), "rate"), (dict(rate=None), "rate"), (dict(n=0), "number of requests"),
    (dict(n=10**6), "too many"), (dict(n=-4), "number of requests"), (dict(burstiness=0), "burstiness"),
    (dict(conc=-2), "max concurrency"), (dict(p_min=-1), "prompt min"), (dict(p_max=5), "prompt length"),
    (dict(o_max=10**6, o_kind="uniform"), "max_model_len"), (dict(seed=1.5), "seed"), (dict(turns=0), "turns"),
])
def test_load_spec_messages(kw, word):
    with pytest.raises(ValueError, match=word):
        ls(**kw)


def test_slo_parsing():
    s = forms.make_slo(200, None, "")
    assert s.ttft_ms == 200 and s.tpot_ms is None and s.e2el_ms is None
    with pytest.raises(ValueError, match="TPOT"):
        forms.make_slo(None, -5, None)


def test_engine_settings_form_covers_every_field_and_roundtrips():
    specs = forms.config_field_specs()
    names = [n for n, _, _ in specs]
    assert names == EngineConfig.field_names()
    cfg = EngineConfig(model="dummy:tiny", num_kv_blocks=64, speculative_method="ngram")
    vals = forms.config_form_values(cfg, names)
    assert forms.config_from_form(names, vals) == cfg
    vals[names.index("block_size")] = 3
    with pytest.raises(ValueError, match="block_size"):
        forms.config_from_form(names, vals)
    vals[names.index("block_size")] = 16
    vals[names.index("max_model_len")] = 0          # 0 / empty means "derive"
    assert forms.config_from_form(names, vals).model_config.max_model_len is None
    vals[names.index("gemv_max_tokens")] = 0        # ... except where 0 is a setting: fused linears off
    assert forms.config_from_form(names, vals).kernel_config.gemv_max_tokens == 0
    vals[names.index("gemv_max_tokens")] = ""
    assert forms.config_from_form(names, vals).kernel_config.gemv_max_tokens is None
    i = names.index("structured_overlap")                # a `bool | None` field: auto / on / off
    assert vals[i] == "auto"
    for choice, value in (("on", True), ("off", False), ("auto", None)):
        vals[i] = choice
        assert forms.config_from_form(names, vals).structured_output_config.structured_overlap is value
    vals[i] = "sometimes"
    with pytest.raises(ValueError, match="structured_overlap"):
        forms.config_from_form(names, vals)


def test_cli_args():
    args = A.parse_args(["--model", "dummy:tiny", "--set", "num_kv_blocks=32", "--set", "enable_prefix_caching=false"])
    cfg = A.config_from_args(args)
    assert cfg.model_config.model == "dummy:tiny" and cfg.cache_config.num_kv_blocks == 32 and not cfg.cache_config.enable_prefix_caching
    assert args.host == "127.0.0.1"
    with pytest.raises(SystemExit):
        A.config_from_args(A.parse_args(["--set", "bogus=1"]))
    assert A.config_from_args(A.parse_args(["--data-parallel-size", "2"])).parallel_config.data_parallel_size == 2
    assert A.api_options_from_args(args) == dict(api_key=None, served_model_name=None, request_timeout=600.0,
                                                 max_body_bytes=4 << 20)
    opts = A.api_options_from_args(A.parse_args(["--api-only", "--api-key", "k", "--request-timeout", "0",
                                                 "--max-body-bytes", "8192"]))
    assert opts == dict(api_key="k", served_model_name=None, request_timeout=None, max_body_bytes=8192)
    with pytest.raises(SystemExit):
        A.api_options_from_args(A.parse_args(["--max-body-bytes", "10"]))


def test_playground_conversation_cap_counts_the_system_prompt():
    cap = forms.MAX_PROMPT_CHARS
    forms.check_conversation([{"role": "system", "content": "s" * (cap // 2)},
                              {"role": "user", "content": "u" * (cap // 2)}])          # exactly the cap: fine
    with pytest.raises(ValueError, match=rf"conversation: too long \({cap + 1} characters with the system prompt"):
        forms.check_conversation([{"role": "system", "content": "s" * (cap // 2 + 1)},
                                  {"role": "user", "content": "u" * (cap // 2)}])
    with pytest.raises(ValueError, match=rf"at most {cap}"):
        forms.check_conversation([{"role": "user", "content": "a" * cap},
                                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
