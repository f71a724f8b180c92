"""EngineConfig: every switch of the engine, in sections as vLLM's VllmConfig (model_config, cache_config, ...).

Each section validates its own fields; EngineConfig validates what spans sections. Flat keywords route to
their section, as vLLM's EngineArgs do: `EngineConfig(model="dummy:tiny", block_size=32)`. Reads name the
section: `config.cache_config.block_size`. `parse_value` turns a field's text (a CLI flag, `--set`, a form box)
into its value, from the field's type annotation.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

# the values a field may take (None: the field's "off" / "derive it" value)
CHOICES: dict[str, tuple] = {
    "dtype": ("auto", "float32", "float16", "bfloat16"),
    "quantization": (None, "fp8", "int8", "int4"),
    "kv_cache_layout": ("paged", "contiguous"),
    "kv_cache_dtype": ("auto", "fp8"),
    "preemption_mode": ("auto", "recompute", "swap"),
    "scheduling": ("continuous", "static"),
    "scheduling_policy": ("fcfs", "priority"),
    "speculative_method": (None, "ngram", "draft", "self"),
    "kernels": ("auto", "torch", "triton"),
    "gemv_variant": ("auto", "tiled", "persistent"),
    "fp8_gemm": ("auto", "triton", "cublas"),
}


class _Checks:
    """need(): the `EngineConfig.<field>: <what is wrong> (got <value>)` error of a section's validation."""

    def need(self, cond: bool, name: str, msg: str) -> None:
        if not cond:
            raise ValueError(f"EngineConfig.{name}: {msg} (got {getattr(self, name)!r})")

    def need_choice(self, name: str) -> None:
        self.need(getattr(self, name) in CHOICES[name], name, f"must be one of {CHOICES[name]}")

    def need_bool(self, *names: str) -> None:
        for name in names:
            self.need(isinstance(getattr(self, name), bool), name, "must be a bool")

    def need_tristate(self, *names: str) -> None:
        for name in names:
            v = getattr(self, name)
            self.need(v is None or isinstance(v, bool), name, "must be None, True or False")

    def need_int(self, name: str, lo: int, hi: int | None = None, optional: bool = False) -> None:
        v = getattr(self, name)
        if optional and v is None:
            return
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)
        what = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
        self.need(ok, name, f"must be None or {what}" if optional else f"must be {what}")


@dataclass(frozen=True)
class ModelConfig(_Checks):
    """The model and the numbers it runs in."""
    model: str | None = None            # HF folder, preset ("dummy:llama-3.2-1b"), or None: the bundled SmolLM2-135M
    device: str = "auto"                # "cpu", "cuda", "cuda:N", or "auto": cuda when available
    dtype: str = "auto"                 # weights and activations; auto: bfloat16 on cuda, float32 on cpu
    seed: int = 0                       # seeds random preset weights and unseeded sampling
    quantization: str | None = None     # decoder linears: fp8 (128x128 blocks), int8 (per channel), int4 (groups)
    int4_group_size: int | None = None  # int4: weights per (scale, min) group along K; None: 32 on the CPU (the
    #                                     GGUF's Q4 groups, which its C++ int4 path takes), 128 on a GPU
    max_model_len: int | None = None    # longest sequence; None: the model's max_position_embeddings, at most 8192
    skip_tokenizer_init: bool = False   # no tokenizer: prompts are token ids, outputs token ids without text (vLLM's)

    def __post_init__(self):
        self.need_bool("skip_tokenizer_init")
        self.need(isinstance(self.device, str) and (self.device in ("auto", "cpu") or self.device.startswith("cuda")),
                  "device", "must be 'auto', 'cpu' or 'cuda[:N]'")
        self.need_choice("dtype")
        self.need_choice("quantization")
        self.need(self.int4_group_size in (None, 32, 64, 128), "int4_group_size", "must be 32, 64 or 128")
        self.need_int("max_model_len", 2, optional=True)


@dataclass(frozen=True)
class CacheConfig(_Checks):
    """The KV cache: its blocks, its size and how requests share it."""
    block_size: int = 16                # tokens per KV block
    num_kv_blocks: int | None = None    # blocks in the KV pool; None: what the memory budget holds
    gpu_memory_utilization: float = 0.9   # cuda: share of the GPU's memory for this engine's weights, activations + KV
    cpu_kv_cache_gib: float = 1.0       # cpu: the KV pool's size in GiB
    enable_kv_cache: bool = True        # False: every step recomputes each request's whole prefix
    enable_prefix_caching: bool = True  # requests reuse the cached blocks of a prompt prefix they share
    kv_cache_layout: str = "paged"      # "contiguous": a request reserves max_model_len slots when admitted, unshared
    kv_cache_dtype: str = "auto"        # "fp8": K/V stored as e4m3 (scale 1.0), twice the blocks per byte; auto: the model's dtype
    kv_offload_gib: float = 0.0         # host (CPU) tier for KV blocks: swapped-out requests and evicted prefix blocks; 0: off
    preemption_mode: str = "auto"       # with the host tier: "swap" or "recompute" a preempted request; auto: the cheaper

    def __post_init__(self):
        self.need(isinstance(self.block_size, int) and 1 <= self.block_size <= 256
                  and self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two in [1, 256]")
        self.need_int("num_kv_blocks", 2, optional=True)
        self.need(isinstance(self.gpu_memory_utilization, (int, float))
                  and 0.05 <= self.gpu_memory_utilization <= 0.98, "gpu_memory_utilization", "must be in [0.05, 0.98]")
        self.need(isinstance(self.cpu_kv_cache_gib, (int, float)) and self.cpu_kv_cache_gib > 0,
                  "cpu_kv_cache_gib", "must be > 0")
        self.need_bool("enable_kv_cache", "enable_prefix_caching")
        self.need_choice("kv_cache_layout")
        self.need_choice("kv_cache_dtype")
        self.need(isinstance(self.kv_offload_gib, (int, float)) and not isinstance(self.kv_offload_gib, bool)
                  and 0 <= self.kv_offload_gib <= 1024, "kv_offload_gib", "must be in [0, 1024] (GiB; 0: off)")
        self.need_choice("preemption_mode")


@dataclass(frozen=True)
class SchedulerConfig(_Checks):
    """What runs in a step, and how many decode iterations a step launches."""
    max_num_batched_tokens: int | None = None  # tokens per step; None: 8192 on cuda, 256 on cpu
    max_num_seqs: int | None = None     # running requests; None: cuda from the KV pool (a request per 512 tokens, <= 1024), cpu 128
    enable_chunked_prefill: bool = True  # a long prompt is prefilled in chunks over several steps, beside decodes
    scheduling: str = "continuous"      # "static": a batch runs until all of its requests finish
    scheduling_policy: str = "fcfs"     # "priority": by (SamplingParams.priority, arrival), preempting worse ones
    max_waiting_requests: int | None = None  # waiting-queue bound (beyond it add_request raises); None: unbounded
    num_scheduler_steps: int | None = None  # decode iterations per host round trip (multi-step); None: 8 cuda, 1 cpu
    multi_step_max_ms: float | None = None  # a multi-step block's time limit (milliseconds); None: no limit
    multi_step_trim: bool = True        # a block stops at its longest request's max_tokens and drops finished ones
    multi_step_admit_min: int | None = None  # full batch: newcomers wait for this many free slots; None: seqs // 32

    def __post_init__(self):
        self.need_int("max_num_batched_tokens", 1, optional=True)
        self.need_int("max_num_seqs", 1, optional=True)
        self.need_bool("enable_chunked_prefill", "multi_step_trim")
        self.need_choice("scheduling")
        self.need_choice("scheduling_policy")
        self.need_int("max_waiting_requests", 1, optional=True)
        self.need_int("num_scheduler_steps", 1, 64, optional=True)
        self.need(self.multi_step_max_ms is None or (isinstance(self.multi_step_max_ms, (int, float))
                                                     and self.multi_step_max_ms > 0),
                  "multi_step_max_ms", "must be None or > 0 (milliseconds)")
        self.need_int("multi_step_admit_min", 1, optional=True)


@dataclass(frozen=True)
class ParallelConfig(_Checks):
    """How the model is split over devices."""
    tensor_parallel_size: int = 1       # ranks sharding the model (a worker process per extra rank; NCCL or gloo)
    data_parallel_size: int = 1         # server: engine replicas (each on its own GPUs) behind one API, requests routed
    disable_custom_all_reduce: bool = False  # NCCL for every all-reduce (else one-shot over peer memory up to 8 MiB)

    def __post_init__(self):
        self.need_int("tensor_parallel_size", 1, 64)
        self.need_int("data_parallel_size", 1, 64)
        self.need_bool("disable_custom_all_reduce")


@dataclass(frozen=True)
class SpeculativeConfig(_Checks):
    """Speculative decoding: who drafts, how many tokens, and when drafting pays."""
    speculative_method: str | None = None  # "ngram" (prompt lookup), "draft" (draft_model), "self" (layer skip)
    num_speculative_tokens: int = 3     # drafts per request per step
    num_speculative_tokens_max: int | None = None  # ngram: k doubles after a fully accepted verify, up to this
    draft_model: str | None = None      # "draft": the drafting model (HF folder or preset)
    ngram_min: int = 1                  # ngram: shortest suffix matched in the request's tokens
    ngram_max: int = 4                  # ngram: longest suffix matched
    draft_layers: int = 8               # "self": the target's first layers that draft
    speculative_auto_off: bool = True   # per request, no drafting while measured acceptance does not pay for it
    spec_cuda_graphs: bool = True       # verify and self-drafting steps replay CUDA graphs per (batch, k) bucket
    spec_cuda_graph_max_batch: int = 32  # largest batch whose verify and draft steps are captured
    spec_fast_verify: bool = True       # all-greedy verify steps pack straight into the graph layout, device argmax
    spec_shadow_every_block: bool = True  # shadow probes replay after every multi-step block; False: after a gap
    spec_shadow_confirm: bool = True    # drafting resumes only when the next block's shadow replay agrees
    spec_prefetch: bool = True          # ngram: a prompt is indexed while its prefill runs
    spec_shadow_probes: bool = True     # auto-off probes a request from its own output instead of a verify step

    def __post_init__(self):
        self.need_choice("speculative_method")
        self.need_int("num_speculative_tokens", 1, 16)
        self.need(self.num_speculative_tokens_max is None or (
            isinstance(self.num_speculative_tokens_max, int)
            and self.num_speculative_tokens <= self.num_speculative_tokens_max <= 16),
            "num_speculative_tokens_max", "must be None or an int in [num_speculative_tokens, 16]")
        self.need(self.num_speculative_tokens_max is None or self.speculative_method in (None, "ngram"),
                  "num_speculative_tokens_max", "applies to n-gram drafting only (model drafts cost a forward each)")
        self.need(self.speculative_method != "draft" or self.draft_model is not None,
                  "draft_model", "is required when speculative_method='draft'")
        self.need(isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                  and 1 <= self.ngram_min <= self.ngram_max, "ngram_min", "must satisfy 1 <= ngram_min <= ngram_max")
        self.need_int("draft_layers", 1)
        self.need_bool("speculative_auto_off", "spec_cuda_graphs", "spec_fast_verify", "spec_shadow_every_block",
                       "spec_shadow_confirm", "spec_prefetch", "spec_shadow_probes")
        self.need_int("spec_cuda_graph_max_batch", 1, 256)

    @property
    def max_speculative_tokens(self) -> int:
        """The most drafts one request can get in a step (0 without speculative decoding)."""
        if not self.speculative_method:
            return 0
        return max(self.num_speculative_tokens, self.num_speculative_tokens_max or 0)


@dataclass(frozen=True)
class StructuredOutputConfig(_Checks):
    """Grammar-constrained decoding: how masks are filled and applied."""
    structured_overlap: bool | None = None  # grammar decode runs pipelined one-iteration blocks; None: on cuda
    structured_multi_step: bool = True  # grammar blocks run up to num_scheduler_steps iterations
    structured_mask_threads: int | None = 2  # llguidance threads filling a step's masks; None: llguidance's default
    fused_token_bitmask: bool = True    # triton kernels: one Triton launch applies the masks; False: torch ops

    def __post_init__(self):
        self.need_tristate("structured_overlap")
        self.need_bool("structured_multi_step", "fused_token_bitmask")
        self.need_int("structured_mask_threads", 1, 256, optional=True)


@dataclass(frozen=True)
class KernelConfig(_Checks):
    """Which kernels run a forward, and which steps replay CUDA graphs."""
    kernels: str = "auto"               # auto: triton on cuda, torch on cpu
    enable_cuda_graphs: bool = True     # cuda: decode-only steps replay CUDA graphs
    cuda_graph_max_batch: int | None = None  # largest decode batch captured; None: max_num_seqs (at most 1024)
    mixed_cuda_graphs: bool = True      # steps mixing prefill chunks and decodes replay a graph per token bucket
    mixed_cuda_graph_max_tokens: int = 2048  # largest token bucket captured for mixed steps
    gemv_max_tokens: int | None = None  # steps up to this many tokens run fused GEMV linears; None: 1 on triton, 0 off
    cpu_decode_layer: bool = True       # cpu, int4 fp32: eager decode-only steps run a layer as one C++ call
    enable_pdl: bool | None = None      # Hopper+: fused GEMVs launch as programmatic dependents; None: per GEMV variant
    gemv_variant: str = "auto"          # bf16 fused GEMV launch: "tiled", "persistent", auto: kernels/gemv.py's table
    fused_qk_norm: bool = True          # Qwen3 q/k RMSNorm in place on the qkv views, a tile of tokens per program
    sampler_one_launch: bool = True     # the Triton sampler's grid fits the chip and reduces in one launch
    quant_gemv_tensor_cores: bool | None = None  # quantized decode GEMVs on tensor cores; None: per shape, sm80+
    quant_gemv_packed: bool | None = None  # quantized decode GEMVs on the packed-word kernel; None: triton on sm90+
    quant_gemm_group_dots: bool = True  # int4 packed prefill GEMM: 8 dots per group on the raw nibble codes
    fp8_activations: bool = True        # fp8 steps above gemv_max_tokens multiply on FP8 tensor cores (sm89+)
    fp8_gemm: str = "auto"              # that FP8 GEMM: "triton", "cublas" (torch scaled_mm), auto: cublas if present

    def __post_init__(self):
        self.need_choice("kernels")
        self.need_bool("enable_cuda_graphs", "mixed_cuda_graphs", "fused_qk_norm", "sampler_one_launch",
                       "quant_gemm_group_dots", "fp8_activations", "cpu_decode_layer")
        self.need_int("cuda_graph_max_batch", 1, 1024, optional=True)
        self.need_int("mixed_cuda_graph_max_tokens", 16, 8192)
        self.need_int("gemv_max_tokens", 0, 16, optional=True)
        self.need_tristate("enable_pdl", "quant_gemv_tensor_cores", "quant_gemv_packed")
        self.need_choice("gemv_variant")
        self.need_choice("fp8_gemm")


@dataclass(frozen=True)
class ObservabilityConfig(_Checks):
    """What the engine measures about its own steps."""
    enable_step_timings: bool = True    # per-region forward timings in step events
    graph_timing_interval: int = 200    # every N-th graph-eligible forward runs eagerly to be timed; 0: never

    def __post_init__(self):
        self.need_bool("enable_step_timings")
        self.need_int("graph_timing_interval", 0)


# section attribute -> its class, in the order fields are listed (forms, flags, to_dict)
SECTIONS: dict[str, type] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "speculative_config": SpeculativeConfig,
    "structured_output_config": StructuredOutputConfig,
    "kernel_config": KernelConfig,
    "observability_config": ObservabilityConfig,
}
# flat field name -> the section attribute holding it
FIELD_SECTION: dict[str, str] = {f.name: attr for attr, cls in SECTIONS.items() for f in fields(cls)}
# EngineConfig defaults a server changes: a bounded waiting queue (over it: 503), and multi-step blocks short
# enough that streamed tokens arrive about every 4 ms (offline LLM.generate keeps whole blocks).
SERVER_ENGINE_DEFAULTS = {"max_waiting_requests": 256, "multi_step_max_ms": 4.0}


@dataclass(frozen=True, init=False)
class EngineConfig:
    """The engine's configuration: one section per concern. Frozen: change it with replace()."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig
    structured_output_config: StructuredOutputConfig
    kernel_config: KernelConfig
    observability_config: ObservabilityConfig

    def __init__(self, *, model_config: ModelConfig | None = None, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None, parallel_config: ParallelConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None,
                 structured_output_config: StructuredOutputConfig | None = None,
                 kernel_config: KernelConfig | None = None, observability_config: ObservabilityConfig | None = None,
                 **flat: Any):
        """Sections given whole, flat fields routed to their section (applied over a section given whole)."""
        unknown = sorted(set(flat) - set(FIELD_SECTION))
        if unknown:
            raise ValueError(f"EngineConfig: unknown field(s) {unknown}")
        given = dict(model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config,
                     parallel_config=parallel_config, speculative_config=speculative_config,
                     structured_output_config=structured_output_config, kernel_config=kernel_config,
                     observability_config=observability_config)
        for attr, cls in SECTIONS.items():
            section = given[attr]
            changes = {k: v for k, v in flat.items() if FIELD_SECTION[k] == attr}
            if section is None:
                section = cls(**changes)
            elif not isinstance(section, cls):
                raise TypeError(f"EngineConfig.{attr}: must be a {cls.__name__} (got {type(section).__name__})")
            elif changes:
                section = dataclasses.replace(section, **changes)
            object.__setattr__(self, attr, section)
        self.validate()

    def validate(self) -> None:
        """The checks that span sections (each section checked its own fields when it was made)."""
        m, c, s = self.model_config, self.cache_config, self.scheduler_config
        p, sp = self.parallel_config, self.speculative_config
        if p.tensor_parallel_size > 1:
            sp.need(sp.speculative_method in (None, "ngram"), "speculative_method",
                    "with tensor_parallel_size > 1 only 'ngram' is supported (a model drafter would run on rank 0 "
                    "alone)")
        if not s.enable_chunked_prefill and None not in (m.max_model_len, s.max_num_batched_tokens):
            s.need(s.max_num_batched_tokens >= m.max_model_len, "max_num_batched_tokens",
                   f"must be >= max_model_len ({m.max_model_len}) when chunked prefill is off, "
                   "or a long prompt could never be scheduled")
        if not c.enable_kv_cache:
            sp.need(sp.speculative_method is None, "speculative_method", "needs the KV cache (enable_kv_cache=True)")
        if c.kv_offload_gib:
            c.need(c.enable_kv_cache and c.kv_cache_layout == "paged", "kv_offload_gib",
                   "needs the paged KV cache (enable_kv_cache=True, kv_cache_layout='paged')")
            c.need(p.tensor_parallel_size == 1, "kv_offload_gib", "is not supported with tensor_parallel_size > 1")
            c.need(sp.speculative_method != "draft", "kv_offload_gib",
                   "is not supported with a draft model (its KV pool is not swapped)")

    def __getattr__(self, name: str):
        if name in FIELD_SECTION:           # a flat read: say where the field lives now
            raise AttributeError(f"EngineConfig.{name}: read it as config.{FIELD_SECTION[name]}.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict:
        """Every field by its flat name (EngineConfig(**d) builds it back)."""
        out = {}
        for attr in SECTIONS:
            out.update(asdict(getattr(self, attr)))
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        return list(FIELD_SECTION)

    @classmethod
    def of(cls, config: "EngineConfig | None" = None, **overrides) -> "EngineConfig":
        """`config` with flat fields overridden, or a config from the overrides alone (the engines' and clients'
        `(config=None, **overrides)` constructors)."""
        if config is None:
            return cls(**overrides)
        return config.replace(**overrides) if overrides else config

    def replace(self, **changes) -> "EngineConfig":
        """A copy with flat fields (or whole sections) changed, validated again."""
        return EngineConfig(**{**{attr: getattr(self, attr) for attr in SECTIONS}, **changes})

    @classmethod
    def from_strings(cls, values: Mapping[str, Any], **typed: Any) -> "EngineConfig":
        """A config from field -> text (each parsed by parse_value), over typed flat keywords."""
        unknown = sorted(set(values) - set(FIELD_SECTION))
        if unknown:
            raise ValueError(f"EngineConfig: unknown field(s) {unknown}")
        return cls(**{**typed, **{k: parse_value(k, v) for k, v in values.items()}})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """A config from the flags of add_cli_args (attributes of `args` that are not fields are ignored)."""
        return cls(**{name: getattr(args, name) for name in FIELD_SECTION if hasattr(args, name)})


# ---------------------------------------------------------------------------------- strings to values
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null", "")
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


@dataclass(frozen=True)
class FieldSpec:
    """One flat field, as parsers and forms need it."""
    name: str
    section: str                        # its section attribute ("cache_config")
    type: type                          # bool, int, float or str
    optional: bool                      # None is a value (the engine decides, or the feature is off)
    default: Any
    choices: tuple | None               # CHOICES[name], if any
    help: str                           # the field's comment in this file

    @property
    def kind(self) -> str:
        """bool, opt_bool, choice, int, opt_int, float, opt_float, str or opt_str."""
        if self.choices is not None:
            return "choice"
        return ("opt_" if self.optional else "") + self.type.__name__


def _comments() -> dict[str, str]:
    """Each section field's comment in this file (flag help, form help); empty where the source is absent."""
    try:
        text = Path(__file__).read_text()
    except OSError:
        return {}
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^    (\w+): [^\n#]*?# ?([^\n]*)$", text, re.M)
            if m.group(1) in FIELD_SECTION}


def _spec(section: str, f: dataclasses.Field, comments: dict[str, str]) -> FieldSpec:
    parts = [p.strip() for p in str(f.type).split("|")]
    base = [p for p in parts if p != "None"]
    assert len(base) == 1 and base[0] in _TYPES, f"EngineConfig.{f.name}: unsupported annotation {f.type!r}"
    return FieldSpec(f.name, section, _TYPES[base[0]], "None" in parts, f.default, CHOICES.get(f.name),
                     comments.get(f.name, ""))


_COMMENTS = _comments()
FIELD_SPECS: dict[str, FieldSpec] = {f.name: _spec(attr, f, _COMMENTS) for attr, cls in SECTIONS.items()
                                     for f in fields(cls)}


def field_specs() -> list[FieldSpec]:
    return list(FIELD_SPECS.values())


def parse_value(name: str, value: Any) -> Any:
    """A field's value from text ("32", "true", "auto", "none") or from an already-typed value (a form's
    number or checkbox). bool: 1/true/yes/on, 0/false/no/off; `bool | None`: also auto/none -> None;
    optional fields: none/null/empty -> None, and "off" for a choice that has None. Ranges and choices are
    checked when the config is built."""
    spec = FIELD_SPECS.get(name)
    if spec is None:
        raise ValueError(f"EngineConfig: unknown field(s) {[name]}")

    def bad(what: str):
        return ValueError(f"EngineConfig.{name}: must be {what} (got {value!r})")

    if isinstance(value, str):
        text = value.strip()
        low = text.lower()
        if spec.optional and (low in _NONE or (spec.type is bool and low == "auto")
                              or (spec.choices is not None and low == "off" and "off" not in spec.choices)):
            return None
        if spec.type is bool:
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise bad("true or false" + (" or auto" if spec.optional else ""))
        if spec.type is int:
            try:
                return int(text)
            except ValueError:
                raise bad("an int" + (" or none" if spec.optional else "")) from None
        if spec.type is float:
            try:
                return float(text)
            except ValueError:
                raise bad("a number" + (" or none" if spec.optional else "")) from None
        return text
    if value is None:
        if spec.optional:
            return None
        raise bad("set")
    if spec.type is bool:
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if spec.type is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            return int(value)
        raise bad("an int")
    if spec.type is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad("a number")
    return str(value)


# ---------------------------------------------------------------------------------- command-line flags
def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
    """One flag per field, grouped by section: `--max-num-seqs 64`; bools (and `bool | None`, whose default is
    auto) as `--enable-prefix-caching / --no-enable-prefix-caching`; "none" sets an optional field to None.
    `defaults` overrides the fields' defaults."""
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - set(FIELD_SPECS))
    if unknown:
        raise ValueError(f"EngineConfig: unknown field(s) {unknown}")
    groups = {attr: parser.add_argument_group(f"engine: {attr} ({cls.__name__})") for attr, cls in SECTIONS.items()}
    for spec in FIELD_SPECS.values():
        default = defaults.get(spec.name, spec.default)
        group = groups[spec.section]
        if spec.type is bool:
            group.add_argument(flag_name(spec.name), dest=spec.name, action=argparse.BooleanOptionalAction,
                               default=default, help=_help(spec, "auto" if default is None else default))
            continue
        if spec.choices is not None:
            metavar = "{" + ",".join("none" if c is None else str(c) for c in spec.choices) + "}"
        else:
            metavar = spec.type.__name__.upper() + ("|none" if spec.optional else "")
        group.add_argument(flag_name(spec.name), dest=spec.name, type=_flag_parser(spec.name), default=default,
                           metavar=metavar, help=_help(spec, "none" if default is None else default))


def _help(spec: FieldSpec, default) -> str:
    return (spec.help + f" (default: {default})").replace("%", "%%").strip()


def _flag_parser(name: str):
    def parse(text: str):
        try:
            return parse_value(name, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = name                 # argparse names the field in its errors
    return parse
