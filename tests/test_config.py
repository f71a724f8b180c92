"""EngineConfig: sections, flat routing, replace, and one parser from strings behind the app's --set, the API
server's flags and the Engine settings form."""
from __future__ import annotations

import argparse
import dataclasses
import json
import pickle

import pytest
import torch

import app as A
from engine.config import (FIELD_SECTION, FIELD_SPECS, SECTIONS, CacheConfig, EngineConfig, KernelConfig, ModelConfig,
                           ParallelConfig, SchedulerConfig, SpeculativeConfig, StructuredOutputConfig, parse_value)
from engine.core.sizing import with_device_defaults
from engine.entrypoints.openai.api_server import add_engine_args, engine_config_from_args
from webui import forms

# every field: a representative value other than the app's default, as text and as the value it parses to
VALUES = {
    "model": ("dummy:tiny", "dummy:tiny"), "device": ("cpu", "cpu"), "dtype": ("float16", "float16"),
    "seed": ("7", 7), "quantization": ("int8", "int8"), "int4_group_size": ("64", 64),
    "max_model_len": ("1024", 1024), "skip_tokenizer_init": ("true", True),
    "block_size": ("32", 32), "num_kv_blocks": ("64", 64), "gpu_memory_utilization": ("0.5", 0.5),
    "cpu_kv_cache_gib": ("0.25", 0.25), "enable_kv_cache": ("false", False),
    "enable_prefix_caching": ("false", False), "kv_cache_layout": ("contiguous", "contiguous"),
    "kv_cache_dtype": ("fp8", "fp8"), "kv_offload_gib": ("0.5", 0.5), "preemption_mode": ("swap", "swap"),
    "max_num_batched_tokens": ("512", 512), "max_num_seqs": ("8", 8), "enable_chunked_prefill": ("false", False),
    "scheduling": ("static", "static"), "scheduling_policy": ("fcfs", "fcfs"), "max_waiting_requests": ("16", 16),
    "num_scheduler_steps": ("4", 4), "multi_step_max_ms": ("2.5", 2.5), "multi_step_trim": ("false", False),
    "multi_step_admit_min": ("2", 2),
    "tensor_parallel_size": ("2", 2),
    "data_parallel_size": ("2", 2),
    "disable_custom_all_reduce": ("true", True),
    "speculative_method": ("ngram", "ngram"), "num_speculative_tokens": ("5", 5),
    "num_speculative_tokens_max": ("8", 8), "draft_model": ("dummy:tiny", "dummy:tiny"), "ngram_min": ("2", 2),
    "ngram_max": ("6", 6), "draft_layers": ("4", 4), "speculative_auto_off": ("false", False),
    "spec_cuda_graphs": ("false", False), "spec_cuda_graph_max_batch": ("16", 16),
    "spec_fast_verify": ("false", False), "spec_shadow_every_block": ("false", False),
    "spec_shadow_confirm": ("false", False), "spec_prefetch": ("false", False),
    "spec_shadow_probes": ("false", False),
    "structured_overlap": ("true", True), "structured_multi_step": ("false", False),
    "structured_mask_threads": ("4", 4), "fused_token_bitmask": ("false", False),
    "kernels": ("torch", "torch"), "enable_cuda_graphs": ("false", False), "cuda_graph_max_batch": ("64", 64),
    "mixed_cuda_graphs": ("false", False), "mixed_cuda_graph_max_tokens": ("512", 512),
    "gemv_max_tokens": ("0", 0),
    "cpu_decode_layer": ("false", False),
    "enable_pdl": ("true", True), "gemv_variant": ("persistent", "persistent"),
    "fused_qk_norm": ("false", False), "sampler_one_launch": ("false", False),
    "quant_gemv_tensor_cores": ("false", False), "quant_gemv_packed": ("true", True),
    "quant_gemm_group_dots": ("false", False), "fp8_activations": ("false", False), "fp8_gemm": ("cublas", "cublas"),
    "enable_step_timings": ("false", False), "graph_timing_interval": ("0", 0),
}
APP_BASE = A.config_from_args(A.parse_args([]))     # the app's engine: priority scheduling, 4 ms blocks


def test_values_cover_every_field():
    assert set(VALUES) == set(EngineConfig.field_names()) == set(FIELD_SPECS)
    base = APP_BASE.to_dict()
    assert [f for f, (_, v) in VALUES.items() if v == base[f] and type(v) is type(base[f])] == []


def _server(field: str, text: str, value) -> EngineConfig:
    ap = argparse.ArgumentParser()
    add_engine_args(ap, defaults={k: v for k, v in APP_BASE.to_dict().items()
                                  if v != FIELD_SPECS[k].default})          # the app's base, as flags' defaults
    flag = "--" + field.replace("_", "-")
    if FIELD_SPECS[field].type is bool:
        argv = [flag if value else "--no-" + flag[2:]]
    else:
        argv = [flag, text]
    return engine_config_from_args(ap.parse_args(argv))


def _widget(field: str, value):
    """What the Engine settings form's widget for `field` hands over when showing `value`."""
    kind = forms.config_field_specs()[EngineConfig.field_names().index(field)][1]
    if kind == "opt_bool":
        return {None: "auto", True: "on", False: "off"}[value]
    if kind == "choice" and value is None:
        return "none"
    return value


@pytest.mark.parametrize("field", list(VALUES))
def test_every_field_parses_the_same_through_app_server_and_form(field):
    text, value = VALUES[field]
    expected = APP_BASE.replace(**{field: value})
    assert getattr(getattr(expected, FIELD_SECTION[field]), field) == value
    app_cfg = A.config_from_args(A.parse_args(["--set", f"{field}={text}"]))
    server_cfg = _server(field, text, value)
    names = EngineConfig.field_names()
    vals = forms.config_form_values(APP_BASE, names)
    vals[names.index(field)] = _widget(field, value)
    form_cfg = forms.config_from_form(names, vals)
    vals[names.index(field)] = text                         # a form value sent as text (the UI's HTTP API)
    form_text_cfg = forms.config_from_form(names, vals)
    assert app_cfg == server_cfg == form_cfg == form_text_cfg == expected
    assert EngineConfig.from_strings({field: text}) == EngineConfig(**{field: value})


def test_app_set_enable_pdl_and_errors(capsys):
    cfg = A.config_from_args(A.parse_args(["--set", "enable_pdl=true", "--set", "quant_gemv_packed=auto"]))
    assert cfg.kernel_config.enable_pdl is True and cfg.kernel_config.quant_gemv_packed is None
    assert A.config_from_args(A.parse_args(["--set", "enable_pdl=off"])).kernel_config.enable_pdl is False
    for bad, word in ((["--set", "enable_pdl=maybe"], "EngineConfig.enable_pdl"),
                      (["--set", "block_size=3"], "EngineConfig.block_size: must be a power of two"),
                      (["--set", "bogus=1"], "unknown EngineConfig field"), (["--set", "block_size"], "FIELD=VALUE")):
        with pytest.raises(SystemExit) as exc:          # one error line, exit status 2, no traceback
            A.config_from_args(A.parse_args(bad))
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert word in err and "Traceback" not in err


def test_server_flag_errors_name_the_field(capsys):
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    with pytest.raises(SystemExit):
        ap.parse_args(["--max-num-seqs", "many"])
    assert "EngineConfig.max_num_seqs: must be an int" in capsys.readouterr().err
    a = ap.parse_args(["--quantization", "none", "--speculative-method", "off", "--num-kv-blocks", "none"])
    cfg = engine_config_from_args(a)
    assert cfg == EngineConfig()
    with pytest.raises(ValueError, match="unknown field"):
        add_engine_args(argparse.ArgumentParser(), defaults={"bogus": 1})


@pytest.mark.parametrize("text, value", [("auto", None), ("none", None), ("", None), (" AUTO ", None), ("on", True),
                                         ("true", True), ("1", True), ("yes", True), ("off", False),
                                         ("false", False), ("0", False), (None, None), (True, True), (False, False)])
def test_parse_optional_bool(text, value):
    assert parse_value("structured_overlap", text) is value


def test_parse_value_by_annotation():
    assert parse_value("enable_prefix_caching", "off") is False
    for bad in ("auto", "none", "maybe"):
        with pytest.raises(ValueError, match=r"EngineConfig.enable_prefix_caching: must be true or false \(got"):
            parse_value("enable_prefix_caching", bad)
    with pytest.raises(ValueError, match="EngineConfig.structured_overlap: must be true or false or auto"):
        parse_value("structured_overlap", "sometimes")
    assert parse_value("num_kv_blocks", "none") is None and parse_value("num_kv_blocks", " 12 ") == 12
    assert parse_value("num_kv_blocks", 12.0) == 12 and parse_value("num_kv_blocks", None) is None
    with pytest.raises(ValueError, match="EngineConfig.num_kv_blocks: must be an int or none"):
        parse_value("num_kv_blocks", "1.5")
    with pytest.raises(ValueError, match="EngineConfig.block_size: must be an int"):
        parse_value("block_size", "none")
    with pytest.raises(ValueError, match="EngineConfig.block_size: must be an int"):
        parse_value("block_size", 2.5)
    with pytest.raises(ValueError, match="EngineConfig.block_size: must be set"):
        parse_value("block_size", None)
    assert parse_value("gpu_memory_utilization", "0.5") == 0.5 and parse_value("multi_step_max_ms", "null") is None
    assert parse_value("speculative_method", "off") is None and parse_value("quantization", "none") is None
    assert parse_value("device", " cuda:1 ") == "cuda:1" and parse_value("model", "") is None
    with pytest.raises(ValueError, match=r"EngineConfig: unknown field\(s\) \['bogus'\]"):
        parse_value("bogus", "1")
    kinds = {s.name: s.kind for s in FIELD_SPECS.values()}
    assert (kinds["enable_pdl"], kinds["max_model_len"], kinds["multi_step_max_ms"], kinds["draft_model"],
            kinds["dtype"], kinds["block_size"], kinds["device"]) == (
        "opt_bool", "opt_int", "opt_float", "opt_str", "choice", "int", "str")
    assert all(s.help for s in FIELD_SPECS.values())        # each field's comment, shown as flag and form help


def test_flat_routing_and_whole_sections():
    cfg = EngineConfig(model="dummy:tiny", block_size=32, enable_prefix_caching=False)
    assert cfg.model_config.model == "dummy:tiny" and cfg.cache_config == CacheConfig(block_size=32,
                                                                                      enable_prefix_caching=False)
    assert cfg.scheduler_config == SchedulerConfig() and cfg.kernel_config == KernelConfig()
    cache = CacheConfig(block_size=64, num_kv_blocks=100)
    cfg = EngineConfig(cache_config=cache, model_config=ModelConfig(model="dummy:tiny"), max_num_seqs=4)
    assert cfg.cache_config is cache and cfg.scheduler_config.max_num_seqs == 4
    cfg = EngineConfig(cache_config=cache, block_size=8)                 # a flat field over a whole section
    assert (cfg.cache_config.block_size, cfg.cache_config.num_kv_blocks) == (8, 100)
    with pytest.raises(TypeError, match="EngineConfig.cache_config: must be a CacheConfig"):
        EngineConfig(cache_config=ModelConfig())
    assert [f.name for f in dataclasses.fields(EngineConfig)] == list(SECTIONS)
    assert EngineConfig.field_names() == list(EngineConfig().to_dict()) == list(FIELD_SECTION)


def test_flat_reads_and_writes_fail_loudly():
    cfg = EngineConfig()
    with pytest.raises(AttributeError, match="read it as config.cache_config.block_size"):
        cfg.block_size  # noqa: B018
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache_config = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache_config.block_size = 32


def test_unknown_fields():
    for make in (lambda: EngineConfig(bogus=1, block_size=32), lambda: EngineConfig().replace(bogus=1),
                 lambda: EngineConfig.from_strings({"bogus": "1"})):
        with pytest.raises(ValueError, match=r"EngineConfig: unknown field\(s\) \['bogus'\]"):
            make()


def test_replace_to_dict_and_pickle():
    cfg = EngineConfig(model="dummy:tiny", num_kv_blocks=64)
    new = cfg.replace(block_size=32, max_num_seqs=4)
    assert (new.cache_config.block_size, new.cache_config.num_kv_blocks, new.scheduler_config.max_num_seqs) == (32, 64, 4)
    assert cfg.cache_config.block_size == 16                             # the original is untouched
    assert new.model_config is cfg.model_config                          # unchanged sections are shared (frozen)
    assert cfg.replace(parallel_config=ParallelConfig(2)).parallel_config.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="EngineConfig.block_size: must be a power of two"):
        cfg.replace(block_size=3)
    d = new.to_dict()
    assert d["block_size"] == 32 and d["model"] == "dummy:tiny" and len(d) == len(FIELD_SECTION)
    assert EngineConfig(**json.loads(json.dumps(d))) == new
    assert pickle.loads(pickle.dumps(new)) == new


def test_sections_validate_their_own_fields():
    for make, match in ((lambda: CacheConfig(block_size=3), "EngineConfig.block_size: must be a power of two"),
                        (lambda: ModelConfig(dtype="int3"), "EngineConfig.dtype: must be one of"),
                        (lambda: SchedulerConfig(num_scheduler_steps=0), "EngineConfig.num_scheduler_steps"),
                        (lambda: ParallelConfig(0), "EngineConfig.tensor_parallel_size: must be an int in"),
                        (lambda: SpeculativeConfig(speculative_method="draft"), "EngineConfig.draft_model: is required"),
                        (lambda: SpeculativeConfig(speculative_method="self", num_speculative_tokens_max=8),
                         "EngineConfig.num_speculative_tokens_max: applies to n-gram"),
                        (lambda: StructuredOutputConfig(structured_mask_threads=0), "structured_mask_threads"),
                        (lambda: KernelConfig(gemv_variant="wide"), r"EngineConfig.gemv_variant: .* \(got 'wide'\)")):
        with pytest.raises(ValueError, match=match):
            make()
    for cls in SECTIONS.values():
        cls()                                                            # the defaults are valid


def test_cross_section_checks():
    ParallelConfig(tensor_parallel_size=2), SpeculativeConfig(speculative_method="ngram")   # each fine alone
    EngineConfig(tensor_parallel_size=2, speculative_method="ngram")        # n-gram drafts on rank 0
    for kw, match in ((dict(tensor_parallel_size=2, speculative_method="self"),
                       "EngineConfig.speculative_method: with tensor_parallel_size > 1 only 'ngram'"),
                      (dict(enable_kv_cache=False, speculative_method="ngram"),
                       "EngineConfig.speculative_method: needs the KV cache"),
                      (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
                       r"EngineConfig.max_num_batched_tokens: must be >= max_model_len \(1024\) .* \(got 512\)")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kw)
        with pytest.raises(ValueError, match=match):
            EngineConfig().replace(**kw)


def test_device_defaults():
    cfg = with_device_defaults(EngineConfig(max_num_seqs=4), torch.device("cpu"))
    assert (cfg.scheduler_config.max_num_batched_tokens, cfg.scheduler_config.max_num_seqs) == (256, 4)
    assert with_device_defaults(cfg, torch.device("cpu")) is cfg
    # int4 groups: 32 on the CPU (its C++ path, a GGUF's grid), 128 on a GPU, the config's own where it sets them
    int4 = EngineConfig(quantization="int4")
    assert int4.model_config.int4_group_size is None
    assert with_device_defaults(int4, torch.device("cpu")).model_config.int4_group_size == 32
    assert with_device_defaults(int4, torch.device("cuda")).model_config.int4_group_size == 128
    assert with_device_defaults(int4.replace(int4_group_size=64), torch.device("cpu")).model_config.int4_group_size == 64
