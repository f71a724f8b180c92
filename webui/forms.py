"""UI inputs to engine objects: every bad value gets a clear message naming its field."""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from engine.config import FIELD_SPECS, EngineConfig, field_specs, parse_value
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.tools import ToolChoice, check_tool_choice, check_tools
from engine.sampling_params import MAX_LOGPROBS, MIN_REPETITION_PENALTY, SamplingParams
from inspector import load as L
from inspector import metrics as M

if TYPE_CHECKING:
    from webui.host import EngineHost

MAX_PROMPT_CHARS = 200_000
PLAYGROUND_MAX_TOKENS = 8192


def check_conversation(messages: list[dict]) -> None:
    """A Playground chat: at most MAX_PROMPT_CHARS characters in all, system prompt and history included."""
    total = sum(len(str(m.get("content") or "")) for m in messages)
    if total > MAX_PROMPT_CHARS:
        raise ValueError(f"conversation: too long ({total} characters with the system prompt and the history; "
                         f"at most {MAX_PROMPT_CHARS}); clear the chat or shorten it")


def parse_num(v, name: str, *, integer: bool = False, lo: float | None = None, hi: float | None = None,
         allow_none: bool = False, lo_exclusive: bool = False):
    """Parse a UI number with a clear message naming the field."""
    if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v)):
        if allow_none:
            return None
        raise ValueError(f"{name}: required")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a number (got {v!r})") from None
    if math.isnan(x) or math.isinf(x):
        raise ValueError(f"{name}: must be a finite number (got {v!r})")
    if integer:
        if x != int(x):
            raise ValueError(f"{name}: must be a whole number (got {v!r})")
        x = int(x)
    if lo is not None and (x <= lo if lo_exclusive else x < lo):
        raise ValueError(f"{name}: must be {'>' if lo_exclusive else '>='} {lo:g} (got {v!r})")
    if hi is not None and x > hi:
        raise ValueError(f"{name}: must be <= {hi:g} (got {v!r})")
    return x


# the playground's structured-output box: label -> StructuredOutputsParams field
STRUCTURED_KINDS = ["none", "JSON schema", "JSON object", "regex", "choice", "grammar (Lark)"]
_SO_FIELD = {"JSON schema": "json", "regex": "regex", "choice": "choice", "grammar (Lark)": "grammar"}


def make_structured(kind, text) -> dict | None:
    """The structured-output box -> StructuredOutputsParams fields (None for "none")."""
    kind = kind or "none"
    if kind == "none":
        return None
    if kind == "JSON object":
        return {"json_object": True}
    if kind not in _SO_FIELD:
        raise ValueError(f"structured output: unknown kind {kind!r}; one of {STRUCTURED_KINDS}")
    text = (text or "").strip()
    if not text:
        raise ValueError(f"structured output: enter the {kind} in the constraint box")
    if kind == "JSON schema":
        try:
            return {"json": json.loads(text)}
        except ValueError as e:
            raise ValueError(f"structured output: the JSON schema is not valid JSON ({e})") from None
    if kind == "choice":
        return {"choice": [c for c in text.split("\n") if c.strip()]}
    return {_SO_FIELD[kind]: text}


TOOL_CHOICES = ["auto", "required", "none"]


def make_tools(text, tool_choice) -> tuple[list[dict] | None, ToolChoice]:
    """The Playground's tools box -> (OpenAI `tools`, the tool choice). The box holds JSON: one tool
    ({"type": "function", "function": {...}}), a bare function ({"name", "description"?, "parameters"}) or a list
    of either. tool_choice: "auto", "required", "none", or a function's name (the named choice)."""
    text = (text or "").strip()
    choice = (tool_choice or "auto").strip()
    if not text:
        if choice not in ("auto", "none"):
            raise ValueError(f"tool choice: {choice!r} needs functions in the tools box")
        return None, ToolChoice("none")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"tools: not valid JSON ({e})") from None
    items = value if isinstance(value, list) else [value]
    items = [t if isinstance(t, dict) and "function" in t else {"type": "function", "function": t} for t in items]
    named = None if choice in TOOL_CHOICES else {"type": "function", "function": {"name": choice}}
    try:
        tools = check_tools(items)
        return tools, check_tool_choice(named or choice, tools)
    except APIError as e:
        raise ValueError(e.message) from None


def make_sampling_params(temperature, top_p, top_k, min_p, max_tokens, min_tokens, repetition_penalty,
                         presence_penalty, frequency_penalty, seed, stop, ignore_eos, logprobs_on, logprobs_n,
                         structured_kind="none", structured_text="",
                         max_model_len: int | None = None) -> SamplingParams:
    cap = min(PLAYGROUND_MAX_TOKENS, max_model_len or PLAYGROUND_MAX_TOKENS)
    mt = parse_num(max_tokens, "max tokens", integer=True, lo=1)
    if mt > cap:
        raise ValueError(f"max tokens: {mt} is too many; at most {cap} here (the engine's max_model_len is "
                         f"{max_model_len})")
    stops = [s for s in (stop or "").replace("\\n", "\n").split("\n") if s] if isinstance(stop, str) else list(stop or [])
    try:
        return SamplingParams(
            temperature=parse_num(temperature, "temperature", lo=0, hi=10), top_p=parse_num(top_p, "top-p", lo=0, hi=1, lo_exclusive=True),
            top_k=parse_num(top_k, "top-k", integer=True, lo=-1), min_p=parse_num(min_p, "min-p", lo=0, hi=1),
            max_tokens=mt, min_tokens=parse_num(min_tokens, "min tokens", integer=True, lo=0, hi=mt),
            repetition_penalty=parse_num(repetition_penalty, "repetition penalty", lo=MIN_REPETITION_PENALTY, hi=10),
            presence_penalty=parse_num(presence_penalty, "presence penalty", lo=-2, hi=2),
            frequency_penalty=parse_num(frequency_penalty, "frequency penalty", lo=-2, hi=2),
            seed=parse_num(seed, "seed", integer=True, lo=0, allow_none=True), stop=stops or None,
            ignore_eos=bool(ignore_eos),
            logprobs=(parse_num(logprobs_n, "logprobs top-n", integer=True, lo=0, hi=MAX_LOGPROBS) if logprobs_on else None),
            structured_outputs=make_structured(structured_kind, structured_text))
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg.replace("SamplingParams.", "")) from None


def make_load_spec(preset_name, num_requests, rate, all_at_once, burstiness, max_concurrency,
                   p_kind, p_min, p_max, o_kind, o_min, o_max, shared_prefix, turns, think_time, seed,
                   temperature, ignore_eos, max_model_len: int | None = None,
                   prompt_source: str = "random ids") -> L.LoadSpec:
    n = parse_num(num_requests, "number of requests", integer=True, lo=1)
    if n > L.MAX_REQUESTS:
        raise ValueError(f"number of requests: too many simulated users ({n}); at most {L.MAX_REQUESTS}")
    if all_at_once:
        r = math.inf
    else:
        r = parse_num(rate, "rate (requests/s)", allow_none=True)
        if r is None or r <= 0:
            raise ValueError(f"rate: must be > 0 requests/s (got {rate!r}); tick 'all at once' for a burst")
    conc = parse_num(max_concurrency, "max concurrency", integer=True, lo=0, allow_none=True)
    spec = L.LoadSpec(
        name=str(preset_name or "custom"), num_requests=n, rate=r,
        burstiness=parse_num(burstiness, "burstiness", lo=0, lo_exclusive=True, hi=100),
        max_concurrency=(conc or None),
        prompt_len=L.LengthDist(str(p_kind), parse_num(p_min, "prompt min tokens", integer=True, lo=1),
                                parse_num(p_max, "prompt max tokens", integer=True, lo=1)),
        output_len=L.LengthDist(str(o_kind), parse_num(o_min, "output min tokens", integer=True, lo=1),
                                parse_num(o_max, "output max tokens", integer=True, lo=1)),
        seed=parse_num(seed, "seed", integer=True, lo=0),
        shared_prefix_len=parse_num(shared_prefix, "shared prefix tokens", integer=True, lo=0, allow_none=True) or 0,
        num_turns=parse_num(turns, "turns per user", integer=True, lo=1, hi=64, allow_none=True) or 1,
        think_time_s=parse_num(think_time, "think time (s)", lo=0, hi=600, allow_none=True) or 0.0,
        temperature=parse_num(temperature, "temperature", lo=0, hi=10, allow_none=True) or 0.0,
        ignore_eos=bool(ignore_eos), prompt_source=str(prompt_source or "random ids"))
    spec.validate(max_model_len)
    return spec


def make_http_runner(host: "EngineHost", spec: L.LoadSpec, slo: M.SLO | None, url, model, key):
    """The load generator's HTTP target: `url` empty = this process's own OpenAI-compatible API."""
    from inspector.http_load import HttpLoadRunner, HttpTarget
    url = str(url or "").strip()
    self_target = not url
    if self_target:
        if not host.self_url:
            raise ValueError("HTTP base URL: this app is not serving the HTTP API here; enter a server's URL")
        url = host.self_url
    key = str(key or "").strip() or (host.api_options.get("api_key") if self_target else None)
    try:
        target = HttpTarget(url, model=str(model or "").strip() or None, api_key=key)
        # records of this server's own requests come from the engine's events; a remote server's only
        # from the wire, so those feed the inspector's latency panel
        return HttpLoadRunner(target, spec, slo=slo, on_record=None if self_target else host.recorder.record_output)
    except ValueError:
        raise
    except Exception as e:   # connection refused, DNS, timeouts: a clear message, never a crash
        raise ValueError(f"HTTP base URL: could not reach {url}: {type(e).__name__}: {e}") from None


def make_slo(ttft, tpot, e2el) -> M.SLO:
    return M.SLO(ttft_ms=parse_num(ttft, "TTFT SLO (ms)", lo=0, lo_exclusive=True, allow_none=True) or None,
                 tpot_ms=parse_num(tpot, "TPOT SLO (ms)", lo=0, lo_exclusive=True, allow_none=True) or None,
                 e2el_ms=parse_num(e2el, "E2EL SLO (ms)", lo=0, lo_exclusive=True, allow_none=True) or None)


# engine settings form: every EngineConfig field, typed (engine.config.FIELD_SPECS)
_NONE_LABEL = {"speculative_method": "off"}             # the label of a choice field's None ("none" otherwise)
CHOICES = {spec.name: [(_NONE_LABEL.get(spec.name, "none") if c is None else c) for c in spec.choices]
           for spec in field_specs() if spec.choices is not None}
CHOICES["device"] = ["auto", "cpu", "cuda"]             # a dropdown that also takes "cuda:N"
TRISTATE = {"auto": None, "on": True, "off": False}     # `bool | None` fields (None: the engine decides)
_ZERO_IS_A_VALUE = {"gemv_max_tokens"}           # optional ints where 0 means "off", not "default"
# the form's help under each field: the field's comment in engine/config.py, or a note on the form's conventions
FIELD_HELP = {spec.name: spec.help for spec in field_specs() if spec.help}
FIELD_HELP.update({
    "model": "HF folder, dummy:<preset> (random weights), or empty for the bundled SmolLM2-135M-Instruct",
    "num_kv_blocks": "0 or empty: derived from the memory budget", "max_model_len": "0 or empty: the model's (≤ 8192)",
    "max_waiting_requests": "0 or empty: unbounded queue",
    "kv_cache_layout": "contiguous = reserve max_model_len slots per request (the pre-paging baseline)",
    "graph_timing_interval": "every N-th graph-eligible step runs eagerly to time it; 0 = never", "enable_kv_cache": "off = recompute the prefix every step",
    "scheduling": "static: a batch runs until all its requests finish",
    "scheduling_policy": "priority: lower SamplingParams.priority first (Playground turns -1, simulated users 0); "
                         "may preempt a worse running request",
    "gpu_memory_utilization": "share of the GPU's memory for this engine: weights, a profiled step's activations and the KV pool (vLLM's meaning)",
    "cpu_kv_cache_gib": "KV pool size on CPU", "enable_step_timings": "per-region timings in step events",
    "gemv_max_tokens": "empty: 1 with Triton kernels; 0 = off (cuBLAS linears, separate norm/activation kernels)",
    "enable_pdl": "Hopper+: small-batch kernels launch as programmatic dependents",
    "mixed_cuda_graphs": "prefill chunks beside decodes replay CUDA graphs per token bucket (padding to the null "
                         "block); off = those steps run eagerly",
    "mixed_cuda_graph_max_tokens": "steps with more tokens than this run eagerly",
    "quantization": "decoder weights: fp8 (128x128 blocks), int8 (per channel), int4 (groups); a pre-quantized "
                    "checkpoint's format is detected",
    "quant_gemv_tensor_cores": "quantized decode linears on tensor cores (weights decoded to 16-bit, rows padded "
                               "to 16); auto: on with Triton on CUDA sm80+",
    "cpu_decode_layer": "CPU, int4 weights, fp32: decode-only steps run each decoder layer as one C++ call "
                        "(kvscope::decode_layer); off = the layer's torch ops",
    "tensor_parallel_size": "ranks sharing the model (one worker process per extra rank; NCCL on consecutive "
                            "GPUs, gloo on CPU); num_heads must split by KV-head groups",
    "data_parallel_size": "engine replicas, each on its own GPUs (all on the CPU), requests routed by load and "
                          "cached prefix; the app runs them in this process and the inspector shows each one",
    "disable_custom_all_reduce": "tensor parallel on one machine's GPUs: NCCL for every all-reduce; off = "
                                 "activations up to 8 MiB summed by one kernel over peer-mapped memory",
    "structured_mask_threads": "llguidance threads filling a step's masks; 0 or empty: llguidance's default",
    "multi_step_admit_min": "full batch: newcomers wait for this many free slots; 0 or empty: max_num_seqs // 32",
})


def config_field_specs() -> list[tuple[str, str, Any]]:
    """(name, kind, default) for every EngineConfig field; kind in bool/opt_bool/choice/int/opt_int/float/opt_float/
    str/opt_str."""
    return [(spec.name, "choice" if spec.name in CHOICES else spec.kind, spec.default) for spec in field_specs()]


def config_from_form(names: list[str], values: list) -> EngineConfig:
    """The form's values (checkboxes, numbers, dropdown labels, text) -> EngineConfig, through
    engine.config.parse_value. Form conventions: an optional number left empty or 0 is None (but where 0 is
    a setting), a `bool | None` dropdown is auto / on / off, a choice's "none" / "off" label is None."""
    kw = {}
    for name, v in zip(names, values):
        if isinstance(v, float) and math.isnan(v):
            v = None
        x = parse_value(name, v)
        if FIELD_SPECS[name].kind == "opt_int" and x == 0 and name not in _ZERO_IS_A_VALUE:
            x = None
        kw[name] = x
    return EngineConfig(**kw)


def config_form_values(cfg: EngineConfig, names: list[str]) -> list:
    """The form's values showing `cfg` (the inverse of config_from_form)."""
    out = []
    d = cfg.to_dict()
    for n in names:
        v, kind = d[n], FIELD_SPECS[n].kind
        if n in CHOICES and v is None:
            v = _NONE_LABEL.get(n, "none")
        elif kind == "opt_str":
            v = v or ""
        elif kind == "opt_bool":
            v = next(k for k, b in TRISTATE.items() if b is v)
        out.append(v)
    return out
