"""EngineConfig: one flat, validated dataclass holding every switch of the engine."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

_SCHEDULING = ("continuous", "static")
_POLICIES = ("fcfs", "priority")
_KERNELS = ("auto", "torch", "triton")
_DTYPES = ("auto", "float32", "float16", "bfloat16")
_SPEC = (None, "ngram", "draft", "self")
_LAYOUTS = ("paged", "contiguous")
_QUANT = (None, "fp8", "int8", "int4")
_GEMV_VARIANTS = ("auto", "tiled", "persistent")


@dataclass
class EngineConfig:
    model: str | None = None            # HF folder, preset name ("dummy:llama-3.2-1b"), or None = bundled SmolLM2
    device: str = "auto"                # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"                 # auto: bfloat16 on cuda, float32 on cpu
    seed: int = 0                       # random weights of presets and unseeded sampling
    quantization: str | None = None     # decoder projection weights: None (dtype), "fp8" (block-wise 128x128),
    #                                     "int8" (per-channel), "int4" (group-wise, 128); quantized on load, or
    #                                     detected from a pre-quantized checkpoint's quantization_config
    int4_group_size: int = 128          # int4: weights per (scale, min) group along K: 32, 64 or 128
    quant_gemv_tensor_cores: bool | None = None  # quantized decode linears (fused GEMVs) on tensor cores:
    #                                     weights decoded to 16-bit in registers, tl.dot on the rows padded to 16
    #                                     (kernels/quant_gemv_tc.py); None: with triton on cuda >= sm80, for
    #                                     the shapes where the sweep found them faster (QUANT_GEMV_TC_CONFIGS)
    quant_gemv_packed: bool | None = None  # quantized decode linears on the packed-word GEMV
    #                                     (kernels/quant_gemv_packed.py: int32 word loads, inline-PTX decodes,
    #                                     split-K): int4 is repacked on load to the words layout and always
    #                                     takes it; int8 too, fp8 where QUANT_GEMV_PACKED_CONFIGS lists the shape,
    #                                     unless the tensor-core GEMV has the shape. None: on with
    #                                     triton on cuda >= sm90; False: the earlier kernels (ablation)
    quant_gemm_group_dots: bool = True  # packed, int4 (groups of 128) prefill GEMM: 8 dots a group on the raw codes
    #                                     of each nibble slice; False: the slices interleaved into one dequantized tile
    fp8_activations: bool = True        # fp8 steps above gemv_max_tokens quantize activations per token-group
    #                                     and multiply on FP8 tensor cores (cuda >= sm89, triton); else bf16 dots
    fp8_gemm: str = "auto"              # that FP8 GEMM (kernels/quant_gemm_fp8.py): "triton" (activations
    #                                     quantized once, then FP8 dots), "cublas" (torch's block-wise scaled_mm;
    #                                     sm90, CUDA >= 12.9); auto: cublas where torch has it, else triton
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None    # None: derived from the memory budget below
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gib: float = 1.0
    enable_kv_cache: bool = True        # False: recompute the whole prefix every step (baseline)
    enable_prefix_caching: bool = True
    kv_cache_layout: str = "paged"      # "paged" | "contiguous": the baseline of the paging lesson, which reserves
    #                                     ceil(max_model_len / block_size) blocks for a request when it is admitted
    #                                     (max_model_len slots, as a per-request max-length cache does) and never
    #                                     shares them (no prefix caching); the same kernels run
    # scheduler
    max_num_batched_tokens: int | None = None  # tokens per step; None: 8192 on cuda, 2048 on cpu
    max_num_seqs: int | None = None     # running requests; None: 256 on cuda (the CUDA-graph sizes), 128 on cpu
    max_model_len: int | None = None    # None: the model's max_position_embeddings (capped at 8192)
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"      # "continuous" | "static" (a batch runs until all finish)
    scheduling_policy: str = "fcfs"     # "fcfs" | "priority": waiting requests by (SamplingParams.priority,
    #                                     arrival); a better one may preempt a worse running one (as vLLM)
    max_waiting_requests: int | None = None  # None: unbounded waiting queue
    # execution
    kernels: str = "auto"               # auto: triton on cuda, torch on cpu
    enable_cuda_graphs: bool = True     # decode-only steps on cuda
    cuda_graph_max_batch: int = 256
    mixed_cuda_graphs: bool = True      # steps mixing prefill chunks and decodes replay a CUDA graph per token
    #                                     bucket (up to mixed_cuda_graph_max_tokens): no Python kernel launches
    mixed_cuda_graph_max_tokens: int = 2048
    enable_step_timings: bool = True    # per-region forward timings in step events
    graph_timing_interval: int = 200    # every N-th graph-eligible forward runs eagerly under the CUDA-event
    #                                     timer instead of replaying its graph (same outputs), so graph-replayed
    #                                     decoding still gets a per-region breakdown (StepEvent.timings_sampled);
    #                                     costs about (eager/graph time - 1) / N; 0: never (graphed steps untimed)
    num_scheduler_steps: int | None = None  # decode iterations per host round trip when the batch is
    #                                         decode-only (multi-step); None: 8 on cuda, 1 on cpu
    multi_step_max_ms: float | None = None  # a multi-step block runs at most about this long (from the
    #                                         measured time per iteration, never below 2 iterations), so streamed
    #                                         tokens reach clients this often; None: num_scheduler_steps always
    multi_step_trim: bool = True        # a multi-step block leaves out the requests that reach max_tokens within the
    #                                     block in flight and runs no iteration past its longest request's
    #                                     max_tokens; False: every running request, num_scheduler_steps iterations
    multi_step_admit_min: int | None = None  # while multi-step decode runs and the batch is full, newcomers
    #                                         wait until this many slots are free (or all of them fit);
    #                                         None: max_num_seqs // 32; 1: a prefill step at every free slot
    gemv_max_tokens: int | None = None  # steps of at most this many tokens run fused GEMV linears (norm,
    #                                         SiLU-mul, residual add inside); None: 1 with triton kernels, 0 = off
    tensor_parallel_size: int = 1       # ranks sharding the model Megatron-style (one worker process per extra
    #                                     rank; NCCL on cuda, gloo on cpu); cuda ranks use consecutive devices
    enable_pdl: bool | None = None      # those linears launch as programmatic dependents on Hopper+ (their
    #                                         first weight tile is fetched while the previous kernel finishes);
    #                                         None: on unless a decode linear takes the persistent GEMV (at the 8B
    #                                         shape on an H200, PDL on 4.87 vs off 4.44 ms/token with it)
    gemv_variant: str = "auto"          # the bf16 fused GEMV's launch: "auto" (kernels/gemv.py GEMV_CONFIGS, swept
    #                                     per projection shape on an H200; the rule elsewhere), "tiled" (the rule:
    #                                     programs of BLOCK_N rows walking K), "persistent" (a few programs per SM,
    #                                     the prologue once per program, whole-K rows streamed a tile or two ahead)
    fused_qk_norm: bool = True          # q/k RMSNorm (Qwen3) in place on the qkv views, a tile of tokens a program;
    #                                     False: q/k copied contiguous, then one program per (token, head) row
    sampler_one_launch: bool = True     # the Triton Gumbel-max sampler sizes its grid to the chip (batch 1: 251
    #                                     programs of 512 logits, not 16 of 8192) and its last program per row
    #                                     reduces the chunk winners: one launch per iteration instead of four
    # speculative decoding
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    num_speculative_tokens_max: int | None = None  # n-gram: a request whose last verify accepted all of its k
    #                                     drafts drafts 2k next time, up to this (a rejection: back to
    #                                     num_speculative_tokens); verify graphs are captured for it too; None: off
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    draft_layers: int = 8
    speculative_auto_off: bool = True   # per request, stop drafting while the measured acceptance would not pay
    #                                     for the measured cost of drafting + verifying (re-probed now and then)
    spec_cuda_graphs: bool = True       # verify steps (k+1 tokens per request) and self-drafting steps replay
    #                                     CUDA graphs per (batch, k) bucket; False: they run eagerly
    spec_cuda_graph_max_batch: int = 32  # largest batch whose verify / draft steps are captured
    spec_fast_verify: bool = True       # a verify step whose requests all decode plain-greedy is packed straight
    #                                     into the padded graph layout and verified from the device argmax (one
    #                                     small copy back); False: the general path (packed, gathered logits)
    spec_shadow_every_block: bool = True  # shadow probes: a request whose drafting is off is replayed after every
    #                                     multi-step block from where the last replay ended (no 16-token gap, no
    #                                     doubling); False: after the gap (README)
    spec_shadow_confirm: bool = True    # shadow probes: a replay that would turn drafting on holds the pipeline
    #                                     after the block in flight, whose replay must agree before drafting resumes
    #                                     (no extra lag: that block returns before any draft could run anyway)
    spec_prefetch: bool = True          # n-gram: a prompt is indexed while its prefill's forward runs, not at the
    #                                     first proposal (a pipeline start, with the device idle)
    spec_shadow_probes: bool = True     # auto-off: a request whose drafting is off is probed from its own output
    #                                     (the draft the proposer would have made earlier, compared with the
    #                                     tokens produced since), not by a verify step, so probes never leave the
    #                                     multi-step pipeline; drafters that can draft for an earlier position
    #                                     (n-gram); the first probe of a request still verifies (if it drafts)
    # structured output
    structured_overlap: bool | None = None  # decode batches with a constrained request run pipelined blocks of
    #                                         one iteration: the next forward starts from the sampled tokens
    #                                         still on the device while the host advances the grammars and
    #                                         fills the next masks; None: on cuda; False: one synced step each
    structured_multi_step: bool = True  # grammar blocks run up to num_scheduler_steps iterations, the host
    #                                     filling each iteration's masks while the GPU runs its forward (no
    #                                     scheduler or post-processing round trip per token); False: one each
    structured_mask_threads: int | None = 2  # llguidance threads that fill a step's masks (None: its default,
    #                                     80% of the CPUs up to 32; more threads cost more wake-ups than they
    #                                     save at batch 32 on the H200 host: 2 measured best)
    fused_token_bitmask: bool = True    # with triton kernels, one Triton launch applies the packed bitmask to
    #                                     the constrained rows; False (or kernels="torch"): torch ops

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"EngineConfig.{name}: {msg} (got {getattr(self, name)!r})")

        need(isinstance(self.block_size, int) and 1 <= self.block_size <= 256
             and self.block_size & (self.block_size - 1) == 0,
             "block_size", "must be a power of two in [1, 256]")
        need(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 2),
             "num_kv_blocks", "must be None or an int >= 2")
        need(0.05 <= self.gpu_memory_utilization <= 0.98, "gpu_memory_utilization", "must be in [0.05, 0.98]")
        need(self.cpu_kv_cache_gib > 0, "cpu_kv_cache_gib", "must be > 0")
        need(self.max_num_batched_tokens is None
             or (isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1),
             "max_num_batched_tokens", "must be None or an int >= 1")
        need(self.max_num_seqs is None or (isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1),
             "max_num_seqs", "must be None or an int >= 1")
        need(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
             "max_model_len", "must be None or an int >= 2")
        need(self.kv_cache_layout in _LAYOUTS, "kv_cache_layout", f"must be one of {_LAYOUTS}")
        need(isinstance(self.graph_timing_interval, int) and self.graph_timing_interval >= 0,
             "graph_timing_interval", "must be an int >= 0 (0 = never)")
        need(self.scheduling in _SCHEDULING, "scheduling", f"must be one of {_SCHEDULING}")
        need(self.scheduling_policy in _POLICIES, "scheduling_policy", f"must be one of {_POLICIES}")
        need(self.kernels in _KERNELS, "kernels", f"must be one of {_KERNELS}")
        need(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}")
        need(isinstance(self.device, str) and (self.device in ("auto", "cpu") or self.device.startswith("cuda")),
             "device", "must be 'auto', 'cpu' or 'cuda[:N]'")
        need(self.quantization in _QUANT, "quantization", f"must be one of {_QUANT}")
        need(self.int4_group_size in (32, 64, 128), "int4_group_size", "must be 32, 64 or 128")
        need(self.speculative_method in _SPEC, "speculative_method", f"must be one of {_SPEC}")
        need(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
             "num_speculative_tokens", "must be an int in [1, 16]")
        need(self.num_speculative_tokens_max is None or (
            isinstance(self.num_speculative_tokens_max, int)
            and self.num_speculative_tokens <= self.num_speculative_tokens_max <= 16),
            "num_speculative_tokens_max", "must be None or an int in [num_speculative_tokens, 16]")
        need(self.num_speculative_tokens_max is None or self.speculative_method in (None, "ngram"),
             "num_speculative_tokens_max", "applies to n-gram drafting only (model drafts cost a forward each)")
        need(1 <= self.ngram_min <= self.ngram_max, "ngram_min", "must satisfy 1 <= ngram_min <= ngram_max")
        need(self.draft_layers >= 1, "draft_layers", "must be >= 1")
        need(self.max_waiting_requests is None or self.max_waiting_requests >= 1,
             "max_waiting_requests", "must be None or >= 1")
        need(self.num_scheduler_steps is None or (isinstance(self.num_scheduler_steps, int)
                                                   and 1 <= self.num_scheduler_steps <= 64),
             "num_scheduler_steps", "must be None or an int in [1, 64]")
        need(self.multi_step_max_ms is None or (isinstance(self.multi_step_max_ms, (int, float))
                                                 and self.multi_step_max_ms > 0),
             "multi_step_max_ms", "must be None or > 0 (milliseconds)")
        need(self.multi_step_admit_min is None or (isinstance(self.multi_step_admit_min, int)
                                                    and self.multi_step_admit_min >= 1),
             "multi_step_admit_min", "must be None or an int >= 1")
        need(self.gemv_max_tokens is None or (isinstance(self.gemv_max_tokens, int)
                                               and 0 <= self.gemv_max_tokens <= 16),
             "gemv_max_tokens", "must be None or an int in [0, 16]")
        need(self.gemv_variant in _GEMV_VARIANTS, "gemv_variant", f"must be one of {_GEMV_VARIANTS}")
        need(isinstance(self.fused_qk_norm, bool), "fused_qk_norm", "must be a bool")
        need(isinstance(self.multi_step_trim, bool), "multi_step_trim", "must be a bool")
        need(isinstance(self.sampler_one_launch, bool), "sampler_one_launch", "must be a bool")
        need(self.enable_pdl in (None, True, False), "enable_pdl", "must be None, True or False")
        need(isinstance(self.tensor_parallel_size, int) and 1 <= self.tensor_parallel_size <= 64,
             "tensor_parallel_size", "must be an int in [1, 64]")
        if self.tensor_parallel_size > 1:
            need(self.speculative_method is None, "speculative_method",
                 "is not supported with tensor_parallel_size > 1 (the drafter would run on rank 0 alone)")
        need(1 <= self.cuda_graph_max_batch <= 1024, "cuda_graph_max_batch", "must be in [1, 1024]")
        need(isinstance(self.mixed_cuda_graph_max_tokens, int) and 16 <= self.mixed_cuda_graph_max_tokens <= 8192,
             "mixed_cuda_graph_max_tokens", "must be an int in [16, 8192]")
        need(isinstance(self.spec_cuda_graph_max_batch, int) and 1 <= self.spec_cuda_graph_max_batch <= 256,
             "spec_cuda_graph_max_batch", "must be an int in [1, 256]")
        need(isinstance(self.spec_shadow_probes, bool), "spec_shadow_probes", "must be a bool")
        need(isinstance(self.spec_shadow_every_block, bool), "spec_shadow_every_block", "must be a bool")
        need(isinstance(self.spec_shadow_confirm, bool), "spec_shadow_confirm", "must be a bool")
        need(isinstance(self.spec_prefetch, bool), "spec_prefetch", "must be a bool")
        need(self.quant_gemv_tensor_cores in (None, True, False), "quant_gemv_tensor_cores",
             "must be None, True or False")
        need(self.quant_gemv_packed in (None, True, False), "quant_gemv_packed", "must be None, True or False")
        need(isinstance(self.quant_gemm_group_dots, bool), "quant_gemm_group_dots", "must be a bool")
        need(self.fp8_gemm in ("auto", "triton", "cublas"), "fp8_gemm", "must be 'auto', 'triton' or 'cublas'")
        need(self.structured_overlap in (None, True, False), "structured_overlap", "must be None, True or False")
        need(isinstance(self.fused_token_bitmask, bool), "fused_token_bitmask", "must be a bool")
        need(isinstance(self.structured_multi_step, bool), "structured_multi_step", "must be a bool")
        need(self.structured_mask_threads is None or (isinstance(self.structured_mask_threads, int)
                                                      and not isinstance(self.structured_mask_threads, bool)
                                                      and 1 <= self.structured_mask_threads <= 256),
             "structured_mask_threads", "must be None or an int in 1..256")
        need(self.speculative_method != "draft" or self.draft_model is not None,
             "draft_model", "is required when speculative_method='draft'")
        if not self.enable_chunked_prefill and None not in (self.max_model_len, self.max_num_batched_tokens):
            need(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                 f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is off, "
                 "or a long prompt could never be scheduled")
        if not self.enable_kv_cache:
            need(self.speculative_method is None, "speculative_method",
                 "needs the KV cache (enable_kv_cache=True)")

    @property
    def max_speculative_tokens(self) -> int:
        """The most drafts one request can get in a step (0 without speculative decoding)."""
        if not self.speculative_method:
            return 0
        return max(self.num_speculative_tokens, self.num_speculative_tokens_max or 0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def replace(self, **changes) -> "EngineConfig":
        d = self.to_dict()
        unknown = set(changes) - set(d)
        if unknown:
            raise ValueError(f"EngineConfig: unknown field(s) {sorted(unknown)}")
        d.update(changes)
        return EngineConfig(**d)
