"""LLMEngine: add_request / step / abort_request. One step is a pipeline read top to bottom:

    schedule -> prepare -> execute -> sample (or verify drafts) -> process outputs

over the scheduler (core/scheduler.py: admission, chunked prefill, preemption; every KV block is allocated
there), the model runner (worker/model_runner.py: tensors, CUDA graphs, the forward), the sampler
(sample/sampler.py) or the drafter's verification (spec/), and the output processor (runtime/output_processor.py:
stops, detokenization). Two strategies change how a step runs, not what it computes: multi-step decode blocks
(worker/multi_step.py: K decode iterations per host round trip, pipelined) and the fast verify path
(spec/fast_verify.py). Structured output is a logits processor (structured/manager.py) between execute and sample.
The engine emits a RequestEvent per lifecycle change and a StepEvent per step while someone listens.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time

import torch

from engine.core.kv_cache_manager import BlockManager
from engine.config import EngineConfig
from engine.runtime.detokenizer import Detokenizer
from engine.distributed.executor import RankFailure
from engine.distributed.parallel_state import SINGLE
from engine.distributed.launch import env_launch
from engine.distributed.start import parallel_layout, start_workers
from engine.distributed.worker import serve_if_worker
from engine.runtime.input_processor import InputProcessor
from engine.kernels import cpu_kernels
from engine.kernels.ops import get_ops, pdl_supported
from engine.worker.model_runner import ModelRunner, kv_bytes_per_block, kv_cache_dtype
from engine.models.config import ModelArchConfig
from engine.models.loader import build_model, load_tokenizer, resolve
from engine.runtime.output_processor import OutputProcessor
from engine.quant.linear import set_fp8_gemm, set_packed, set_tensor_cores, weight_bytes
from engine.outputs import RequestOutput
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput, SwapCostModel
from engine.core.sequence import Sequence
from engine.events import EventBus, StepFailureEvent
from engine.runtime.step_events import phase_of, request_event, step_event

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)   # vLLM's
from engine.structured.manager import StructuredOutputManager
from engine.worker.multi_step import MultiStepDecoder
from engine.core.sizing import (derive_max_model_len, derive_max_num_seqs, derive_num_blocks, draft_model_bytes,
                                 profile_step_bytes, resident_bytes, with_device_defaults)
from engine.worker.timing import NullTimer, make_timer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# SwapCostModel's starting (copy bytes/s each way, prefill tokens/s) by device (cuda?): pinned PCIe copies and a
# small model's prefill on an H100-class GPU; a CPU's memcpy and its prefill (SmolLM2, 2 cores). The prefill
# rate then follows the engine's measured steps.
SWAP_COST_DEFAULTS = {True: (20e9, 20000.0), False: (4e9, 400.0)}


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (EngineConfig.max_waiting_requests): retry later."""


@dataclasses.dataclass
class ComputedStep:
    """What a scheduled batch's prepare -> execute -> sample produced, before anything is committed."""
    new_tokens: list[list[int]]         # per sequence
    lp_rows: list
    graphed: bool
    decode_only: bool
    num_spec: int
    constrained: bool
    t_prep: float
    t_fwd: float
    t_mask: float
    t_sample: float


class RequestFailed(RuntimeError):
    """A request whose rows made an engine step raise; it was failed alone, its batch-mates ran on."""


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """The engine's device, with an index on cuda (cuda:N; under torchrun cuda:LOCAL_RANK for "cuda"/"auto")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device: {name!r} requested but CUDA is not available")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank if local_rank is not None else torch.cuda.current_device())
    return device


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine_index: int = 0, **overrides):
        config = EngineConfig.of(config, **overrides)
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("EngineConfig.data_parallel_size: an LLMEngine is one replica; replicas run behind "
                             "the API server (--data-parallel-size) or LLM(data_parallel_size=N) "
                             f"(got {config.parallel_config.data_parallel_size})")
        launch = env_launch() if config.parallel_config.tensor_parallel_size > 1 else None
        serve_if_worker(launch)             # torchrun, ranks > 0: a worker until rank 0 closes, then exit
        self.device = resolve_device(config.model_config.device, launch.local_rank if launch else None)
        # Triton launches on the thread's current device, not on its tensors' one
        self._cuda_index = self.device.index if self.device.type == "cuda" else None
        if self._cuda_index is not None:
            torch.cuda.set_device(self.device)
        self.config = config = with_device_defaults(config, self.device)
        self.dtype = (torch.bfloat16 if self.device.type == "cuda" else torch.float32) \
            if config.model_config.dtype == "auto" else _DTYPES[config.model_config.dtype]
        self.kernels = config.kernel_config.kernels if config.kernel_config.kernels != "auto" else \
            ("triton" if self.device.type == "cuda" else "torch")
        self.ops = get_ops(self.kernels)
        self.fused_sampling = self.kernels == "triton" and (
            "one_launch" if config.kernel_config.sampler_one_launch else True)
        self.num_scheduler_steps = config.scheduler_config.num_scheduler_steps or (
            8 if self.device.type == "cuda" else 1)
        overlap = config.structured_output_config.structured_overlap
        # pipelined one-iteration blocks with grammars; auto: on cuda
        self.structured_overlap = overlap if overlap is not None else self.device.type == "cuda"
        self.arrivals_pending = False      # set by EngineLoop while submitted requests wait in its inbox
        self.engine_index = engine_index    # this engine's data-parallel replica (its events carry it)
        torch.manual_seed(config.model_config.seed)

        hf_cfg, weights, tok_folder = resolve(config.model_config.model)
        self.arch_config = mcfg = ModelArchConfig.from_hf(hf_cfg)
        self.model_name = config.model_config.model or "SmolLM2-135M-Instruct"
        self.max_model_len = derive_max_model_len(config, mcfg)
        spec_margin = config.speculative_config.max_speculative_tokens + 1
        gemv_max_tokens = config.kernel_config.gemv_max_tokens
        if gemv_max_tokens is None:
            gemv_max_tokens = 1 if self.kernels == "triton" else 0
        pdl = config.kernel_config.enable_pdl
        if pdl is None:                     # auto: off where a decode linear takes the persistent GEMV
            from engine.kernels.gemv import persistent_linears
            pdl = not (self.kernels == "triton" and config.parallel_config.tensor_parallel_size == 1
                       and persistent_linears(mcfg, config.kernel_config.gemv_variant, self.device))
        gemv_pdl = pdl and self.kernels == "triton" and pdl_supported(self.device)
        cuda = self.kernels == "triton" and self.device.type == "cuda"
        cap = torch.cuda.get_device_capability(self.device) if cuda else (0, 0)
        self.fp8_act = config.kernel_config.fp8_activations and cuda and cap >= (8, 9)
        tc = config.kernel_config.quant_gemv_tensor_cores
        if tc is None and not (cuda and cap >= (8, 0)):
            tc = False
        self.quant_tensor_cores = tc            # None: per shape, where the sweep found tensor cores faster
        pk = config.kernel_config.quant_gemv_packed
        if pk is None:
            pk = cuda and cap >= (9, 0)
        self.quant_packed = bool(pk) and self.kernels == "triton"
        self.executor = None
        if config.parallel_config.tensor_parallel_size > 1:
            self.executor = start_workers(
                config, hf_cfg, weights, self.device, launch, dtype=str(self.dtype).replace("torch.", ""),
                kernels=self.kernels, max_pos=self.max_model_len + spec_margin, gemv_max_tokens=gemv_max_tokens,
                gemv_pdl=gemv_pdl, fp8_activations=self.fp8_act, quant_packed=self.quant_packed,
                quant_tensor_cores=self.quant_tensor_cores)
        self.parallel_layout = parallel_layout(config.parallel_config.tensor_parallel_size, self.device, launch,
                                               one_shot=self.executor is not None and self.executor.tp.custom is not None)
        try:
            self._build(config, hf_cfg, weights, tok_folder, mcfg, spec_margin, gemv_max_tokens, gemv_pdl)
        except BaseException:
            self.stop_workers()
            raise

    def _build(self, config: EngineConfig, hf_cfg: dict, weights, tok_folder, mcfg: ModelArchConfig,
               spec_margin: int, gemv_max_tokens: int, gemv_pdl: bool) -> None:
        ex = self.executor
        self.model = build_model(hf_cfg, weights, self.ops, self.device, self.dtype,
                                 max_pos=self.max_model_len + spec_margin, seed=config.model_config.seed,
                                 tp=ex.tp if ex is not None else SINGLE,
                                 quantization=config.model_config.quantization, fp8_activations=self.fp8_act,
                                 int4_group_size=config.model_config.int4_group_size)
        self.quantization = self.model.quantization      # the config's, or the checkpoint's (detected)
        if self.device.type == "cpu" and self.quantization in ("fp8", "int8"):
            log.warning("%s weights on the CPU are dequantized at every call (no CPU kernel reads them): they save "
                        "memory but decode slower than float32 weights; int4 is the CPU's fast quantized path",
                        self.quantization)
        if self.model.quantization:
            set_packed(self.model, self.quant_packed, config.kernel_config.quant_gemm_group_dots)
        set_tensor_cores(self.model, self.quant_tensor_cores)
        set_fp8_gemm(self.model, config.kernel_config.fp8_gemm)   # the fp8 layers that quantize activations (fp8_act)
        self.weight_summary = weight_bytes(self.model)   # bytes by dtype and per layer (the inspector shows it)
        self.model.gemv_max_tokens, self.model.gemv_pdl = gemv_max_tokens, gemv_pdl
        self.model.cpu_decode_layer = config.kernel_config.cpu_decode_layer and self.device.type == "cpu" \
            and self.kernels == "torch" and ex is None
        self.model.set_kernel_options(config)
        if ex is not None:
            ex.wait_loaded()
        self.tokenizer = None if config.model_config.skip_tokenizer_init else load_tokenizer(tok_folder)
        self.weight_bytes = resident_bytes(self.model)
        sized = config.cache_config.num_kv_blocks is None
        if ex is not None and sized:
            ex.send("profile")                  # the ranks profile a full step together (its collectives)
        step_bytes = profile_step_bytes(self.model, mcfg, config, self.device, self.dtype,
                                        self.max_model_len + spec_margin) if sized else None
        draft_weights, draft_block = draft_model_bytes(config, self.dtype)    # a draft model's pool has the same blocks
        self.num_blocks = derive_num_blocks(config, self.model.cfg, self.device, self.dtype,
                                            self.weight_bytes + draft_weights, step_bytes, draft_block)   # this rank's heads
        if ex is not None and sized:
            self.num_blocks = ex.min_blocks(self.num_blocks)    # every rank's pool holds the same blocks
        if config.scheduler_config.max_num_seqs is None:                   # a GPU's default: from the pool
            self.config = config = config.replace(
                max_num_seqs=derive_max_num_seqs(self.num_blocks, config.cache_config.block_size))
        self.block_size = config.cache_config.block_size
        cap = (self.num_blocks - 1) * config.cache_config.block_size
        if cap < self.max_model_len:
            if config.model_config.max_model_len is not None:
                raise ValueError(f"EngineConfig.num_kv_blocks: {self.num_blocks - 1} usable blocks of "
                                 f"{config.cache_config.block_size} tokens hold {cap} tokens, less than max_model_len "
                                 f"({self.max_model_len}); one sequence could never fit")
            self.max_model_len = cap
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.num_kv_blocks: the KV pool holds {cap} tokens; need at least 2")
        self.eos_token_ids = set(mcfg.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        prefix = config.cache_config.enable_prefix_caching and config.cache_config.enable_kv_cache
        reserve = -(-self.max_model_len // config.cache_config.block_size) \
            if config.cache_config.kv_cache_layout == "contiguous" else 0
        kv_dtype = kv_cache_dtype(config, self.dtype)
        block_bytes = kv_bytes_per_block(self.model.cfg, config.cache_config.block_size, kv_dtype)
        self.num_host_blocks = int(config.cache_config.kv_offload_gib * (1 << 30)) // block_bytes
        self.block_manager = BlockManager(self.num_blocks, config.cache_config.block_size, prefix, reserve,
                                          self.num_host_blocks)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        if self.num_host_blocks:
            self.scheduler.cost_model = SwapCostModel(block_bytes, *SWAP_COST_DEFAULTS[self.device.type == "cuda"])
        self.runner = ModelRunner(self.model, mcfg, config, self.device, self.dtype, self.num_blocks,
                                  self.max_model_len + spec_margin, self.num_host_blocks)
        if ex is not None:
            ex.send("cache", self.num_blocks, self.max_model_len + spec_margin)
            self.runner.executor = ex
        self.runner.warmup()
        if ex is not None:
            ex.send("warmup")
        self.slot_bytes = kv_bytes_per_block(mcfg, 1, self.runner.kv_dtype)   # K and V of one token, all layers
        self.detok = Detokenizer(self.tokenizer)
        self.structured = StructuredOutputManager(
            self.tokenizer, mcfg.vocab_size, self.eos_token_ids, self.device,
            fused_bitmask=config.structured_output_config.fused_token_bitmask and self.kernels == "triton",
            mask_threads=config.structured_output_config.structured_mask_threads)
        self.input_processor = InputProcessor(self.tokenizer, mcfg.vocab_size, self.max_model_len, self.block_size,
                                              self.num_blocks, self.structured.compiler, self.eos_token_ids)
        generator = torch.Generator(device=self.device).manual_seed(config.model_config.seed)
        self.sampler = Sampler(self.eos_token_ids, generator, self.fused_sampling)
        self.sampler.warmup(mcfg.vocab_size, config.scheduler_config.max_num_seqs * spec_margin, self.device)
        self.output_processor = OutputProcessor(self.scheduler, self.block_manager, self.detok, self.eos_token_ids,
                                                self.max_model_len, config.cache_config.enable_kv_cache)
        self.multi_step = MultiStepDecoder(config, self.scheduler, self.runner, self.sampler, self.structured,
                                           self.max_model_len, self.num_scheduler_steps, self.structured_overlap)
        self.events = EventBus()
        self.seqs: dict[str, Sequence] = {}     # unfinished requests by id
        self.step_index = 0
        self._timer = make_timer(True, self.device) if config.observability_config.enable_step_timings else NullTimer()
        self._profile_next = False
        self.last_profile: list[dict] | None = None
        self.stats_total = dict(prompt_tokens=0, finished=0, aborted=0, failed=0, step_failures=0)
        self.failed: dict[str, str] = {}        # request id -> why its step failed (EngineLoop.pop_failed)
        self._block_suspects: set[str] = set()  # requests of a multi-step block that raised: single steps
        # tokens per model iteration as vLLM's iteration_tokens_total counts them (the tokens generated, plus the
        # prompt of each request that got its first token; each iteration of a multi-step block counts): a count
        # per bucket of ITERATION_TOKEN_BUCKETS (the last: above them all), and their sum
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.drafter = self.fast_verify = None
        if config.speculative_config.speculative_method:
            from engine.spec import FastVerify, make_drafter
            self.drafter = make_drafter(self)
            self.fast_verify = FastVerify(self)
            self.output_processor.drafter = self.multi_step.drafter = self.drafter
        if self.device.type == "cuda" and config.kernel_config.enable_cuda_graphs and self.kernels == "triton":
            from engine.worker.cuda_graphs import CudaGraphRunner
            self.runner.graphs = CudaGraphRunner(self.runner, config)
            if ex is not None:
                ex.capture()                        # every rank captures the same graphs, collectives included
            self.runner.graphs.capture()
            if ex is not None:
                ex.wait_captured()

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False) -> str:
        return self.input_processor.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, arrival_time: float | None = None) -> Sequence:
        """Validate a request without touching engine state (safe from any thread)."""
        return self.input_processor.make_sequence(prompt, params, request_id, arrival_time)

    def add_sequence(self, seq: Sequence) -> str:
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id: {seq.request_id!r} is already in use")
        limit = self.config.scheduler_config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            self._emit_request("rejected", seq, message="waiting queue full")
            raise EngineOverloaded(f"max_waiting_requests: the waiting queue is full ({limit} requests)")
        self.detok.start(seq)
        self.seqs[seq.request_id] = seq
        self.structured.add(seq)
        seq.metrics.queued_time = time.perf_counter()
        self.scheduler.add(seq)
        self.stats_total["prompt_tokens"] += seq.num_prompt_tokens
        self._emit_request("arrived", seq)
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int | None = None) -> str:
        if priority is not None and (params is None or isinstance(params, SamplingParams)):
            params = dataclasses.replace(params or SamplingParams(), priority=priority)   # SamplingParams.priority
        return self.add_sequence(self.make_sequence(prompt, params, request_id, arrival_time))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        seq.metrics.finished_time = time.perf_counter()
        self._finished(seq)
        return self.output_processor.make_output(seq, [])

    def _finished(self, seq: Sequence, failed: str | None = None) -> None:
        """Bookkeeping of a request the scheduler has finished (its blocks are free); `failed`: why its step
        raised (then it counts as failed, not aborted)."""
        self.seqs.pop(seq.request_id, None)
        self.structured.remove(seq)
        kind = "failed" if failed else "aborted" if seq.finish_reason == "abort" else "finished"
        self.stats_total[kind] += 1
        self._emit_request(kind, seq, finish_reason=seq.finish_reason, message=failed)

    def pop_failed(self) -> dict[str, str]:
        """Requests failed since the last call ({request id: why}); their outputs finish with "abort"."""
        failed, self.failed = self.failed, {}
        return failed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._cuda_index is not None and torch.cuda.current_device() != self._cuda_index:
            torch.cuda.set_device(self._cuda_index)     # per thread: the loop that steps did not build the engine
        if self._profile_next:
            self._profile_next = False
            return self._profiled_step()
        return self._step()

    def _step(self) -> list[RequestOutput]:
        observe = self.events.active
        timer = self._timer if observe else NullTimer()
        self.runner.set_timer(timer)
        timer.start_step()
        t0 = time.perf_counter()
        ms = self.multi_step
        ms.drop_finished()
        if self.drafter is not None and ms.inflight is None:     # (a multi-step block in flight: all off)
            self.drafter.propose(self.scheduler.running)
        if self._block_suspects:
            self._block_suspects &= self.seqs.keys()
        K, mixed = 0, None
        if ms.enabled and ms.inflight is None and not self._block_suspects:
            K = ms.plan(self.arrivals_pending)
            mixed = None if K else ms.mixed_plan(self.arrivals_pending)
        if K or mixed or ms.inflight is not None:
            outputs = self._block_step(K, observe, timer, mixed)
            if outputs is not None:
                return outputs                  # (None: the block raised; a single step isolates the cause)

        # schedule: who runs, how many tokens; blocks are allocated here only
        sched = self.scheduler.schedule()
        self.runner.swap_blocks(sched.blocks_to_swap_out, sched.blocks_to_swap_in)
        t_sched = time.perf_counter()
        for seq in sched.preempted:
            self._emit_request("preempted", seq)
        for seq in sched.swapped_out:
            self._emit_request("swapped_out", seq)
        for seq in sched.swapped_in:
            self._emit_request("swapped_in", seq)
        for seq in sched.admitted:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = t_sched
            self._emit_request("scheduled", seq)
        if sched.is_empty:
            if observe and sched.preempted:
                self._emit_step(sched, t0, time.perf_counter(), [], {"schedule": t_sched - t0})
            return []
        try:
            done = self._compute(sched, observe)
        except RankFailure:
            raise                               # a dead tensor-parallel rank: no request is to blame
        except Exception as e:  # noqa: BLE001 - fail only the requests that raise, run the others
            if self.executor is not None:
                self.executor.check()           # (raises RankFailure when a rank died with this step)
            return self._isolate(sched, e, observe, timer, t0, t_sched)
        outputs = self._finish_step(sched, done, observe, timer, t0, t_sched)
        self._launch_next_block()
        return outputs

    def _launch_next_block(self) -> None:
        """After a synchronous step, launch the decode block the next step would start with, before this step's
        outputs go to the clients: the GPU runs it while they are sent and newcomers are taken in."""
        ms = self.multi_step
        if not ms.enabled or ms.inflight is not None or self._block_suspects or self.drafter is not None:
            return                      # (a drafter proposes at the start of a step, before any block is planned)
        K = ms.plan(self.arrivals_pending)
        mixed = None if K else ms.mixed_plan(self.arrivals_pending)
        if not (K or mixed):
            return
        try:
            ms.inflight = ms.launch(K) if K else ms.launch_mixed(mixed)
        except Exception as e:  # noqa: BLE001 - single steps isolate the cause, as for a block that raised
            self._block_failed(e)

    def _compute(self, sched: SchedulerOutput, observe: bool) -> "ComputedStep":
        """prepare -> execute -> [grammar masks] -> sample | verify for a scheduled batch. Commits nothing:
        when it raises, the batch (or any part of it) can run again."""
        if observe:
            kv = self.config.cache_config.enable_kv_cache
            sched.phases = [phase_of(seq, n - k, start, kv) for seq, n, start, k in
                            zip(sched.seqs, sched.num_new_tokens, sched.computed_before, sched.num_spec_tokens)]
            sched.total_lens = [seq.num_tokens for seq in sched.seqs]
        sample_mask = [start + n == seq.num_tokens + len(seq.spec_token_ids)
                       for seq, n, start in zip(sched.seqs, sched.num_new_tokens, sched.computed_before)]
        extra = list(sched.num_spec_tokens) if self.drafter is not None else None
        decode_only = self.drafter is not None and all(       # auto-off measures decode-only step times
            seq.num_output_tokens and start == seq.num_tokens - 1 and n == k + 1
            for seq, n, start, k in zip(sched.seqs, sched.num_new_tokens, sched.computed_before, sched.num_spec_tokens))

        # prepare + execute: one forward (or the fast verify path's graph replay)
        fast = self.fast_verify.plan(sched) if self.fast_verify is not None else None
        if fast is not None and any(seq.prompt_logprobs is not None for seq in sched.seqs):
            fast = None
        if fast is not None:        # plain-greedy verify step: padded graph layout packed directly, argmax ids back
            graphed = self.fast_verify.launch(sched, fast)
            t_prep = t_fwd = time.perf_counter()
        else:
            input_ids, md = self.runner.prepare(sched, sample_mask, extra)
            t_prep = time.perf_counter()
            logits = self.runner.execute(input_ids, md)
            if md.prompt_logits:                # prompt logprobs out, the sampled rows stay (same forward)
                logits = self.output_processor.take_prompt_logprobs(sched.seqs, md.prompt_logits, logits)
            if self.drafter is not None and not decode_only:    # while the prefill runs on the device
                self.drafter.prefetch(sched)
            t_fwd, graphed = time.perf_counter(), md.graphed

        # structured output: grammar masks on the logits (on CUDA the host fills them while the forward runs)
        constrained = self.structured.num_constrained > 0
        if constrained:
            rows = []                                   # the sequence whose next token each logits row samples
            for i, (seq, m) in enumerate(zip(sched.seqs, sample_mask)):
                if m:
                    rows += [seq] + [None] * (extra[i] if extra else 0)
            self.structured.apply(rows, logits)
        t_mask = time.perf_counter()

        # sample, or verify the drafts
        num_spec = max(sched.num_spec_tokens, default=0)
        if fast is not None:
            new_tokens, lp_rows = self.drafter.verify_greedy(sched, self.fast_verify.targets(), fast[1])
        elif num_spec:
            new_tokens, lp_rows = self.drafter.verify(sched, sample_mask, logits)
        else:
            new_tokens, lp_rows = self.sampler(sched.seqs, sample_mask, logits)
        t_sample = time.perf_counter()
        if self.executor is not None:
            self.executor.check()               # a rank that died mid-step leaves these tokens meaningless
        return ComputedStep(new_tokens, lp_rows, graphed, decode_only, num_spec, constrained, t_prep, t_fwd, t_mask,
                            t_sample)

    def _finish_step(self, sched: SchedulerOutput, done: "ComputedStep", observe: bool, timer, t0: float,
                     t_sched: float) -> list[RequestOutput]:
        """process outputs (append, stop, detokenize) and events for a computed batch."""
        ms = self.multi_step
        outputs, finished, num_tokens = self._process_outputs(sched, done.new_tokens, done.lp_rows)
        if num_tokens:
            self._count_iteration(num_tokens)
        if self.drafter is not None:
            self.drafter.shadow_probe(sched.seqs)
        t_end = time.perf_counter()
        self.step_index += 1
        num_spec = done.num_spec
        if self.config.scheduler_config.multi_step_max_ms and sched.num_tokens == len(sched.seqs):
            ms.observe_iteration(t_end - t0)    # a decode-only step: one iteration
        if done.decode_only and (num_spec or self.num_scheduler_steps == 1):   # (multi-step: a block's iteration)
            self.drafter.observe_step(len(sched.seqs), num_spec, t_end - t0)
        if self.scheduler.cost_model is not None:           # the prefill rate a recompute would run at
            self.scheduler.cost_model.observe(sched.num_tokens, t_end - t0)
        if observe:
            t_prep, t_fwd, t_mask, t_sample = done.t_prep, done.t_fwd, done.t_mask, done.t_sample
            timings = {"schedule": t_sched - t0, "prepare": t_prep - t_sched, "forward": t_fwd - t_prep,
                       "sampling": t_sample - t_mask, "postprocess": t_end - t_sample}
            if done.constrained:
                timings["grammar mask"] = t_mask - t_fwd
            timings.update(timer.collect())
            self._emit_step(sched, t0, t_end, finished, timings, cuda_graph=done.graphed,
                            rank_timings=self.collect_rank_timings())
        else:
            self.block_manager.pop_step_stats()
        return outputs

    # ---- step failures -----------------------------------------------------------------------------
    def _isolate(self, sched: SchedulerOutput, err: Exception, observe: bool, timer, t0: float, t_sched: float
                 ) -> list[RequestOutput]:
        """The batch's compute raised: run it again in halves (each half that runs is a step of its own, its
        requests' tokens those of any batch), split the halves that raise until a request raises alone, and
        fail those requests; the others keep running, their blocks untouched."""
        self.stats_total["step_failures"] += 1
        log.warning("engine step %d failed (%s: %s); isolating the requests that caused it", self.step_index,
                    type(err).__name__, err)
        outputs: list[RequestOutput] = []
        culprits: list[tuple[Sequence, Exception]] = []
        retries = 0

        def attempt(idx: list[int]) -> Exception | None:
            nonlocal retries
            retries += 1
            sub = sched.subset(idx)
            t_sub = time.perf_counter()
            try:
                done = self._compute(sub, observe)
            except Exception as e:  # noqa: BLE001
                return e
            outputs.extend(self._finish_step(sub, done, observe, timer, t_sub, t_sub))
            return None

        def bisect(idx: list[int], e: Exception) -> None:
            if len(idx) == 1:
                culprits.append((sched.seqs[idx[0]], e))
                return
            for half in (idx[:len(idx) // 2], idx[len(idx) // 2:]):
                e_half = attempt(half)
                if e_half is not None:
                    bisect(half, e_half)

        bisect(list(range(len(sched.seqs))), err)
        for seq, e in culprits:
            outputs.append(self._fail_request(seq, e))
        if self.events.active:
            self.events.emit(StepFailureEvent(step=self.step_index, time=time.perf_counter(),
                                              error=f"{type(err).__name__}: {err}",
                                              failed=[s.request_id for s, _ in culprits],
                                              num_requests=len(sched.seqs), num_retries=retries,
                                              engine_index=self.engine_index))
        return outputs

    def _fail_request(self, seq: Sequence, err: Exception) -> RequestOutput:
        """Finish seq as failed (finish reason "abort"; its blocks are freed); EngineLoop fails its stream."""
        why = f"{type(err).__name__}: {err}"
        log.warning("request %s failed in an engine step: %s", seq.request_id, why)
        self.scheduler.finish(seq, "abort")
        seq.metrics.finished_time = time.perf_counter()
        self.failed[seq.request_id] = why
        if len(self.failed) > 1024:             # an offline caller that never pops them keeps only the latest
            self.failed.pop(next(iter(self.failed)))
        self._finished(seq, failed=why)
        return self.output_processor.make_output(seq, [])

    def _block_failed(self, err: Exception) -> None:
        """A multi-step block raised: drop the blocks in flight (their tokens were not processed; the KV slots
        they wrote are written again) and run single steps, which isolate the cause, until its requests end."""
        ms = self.multi_step
        self.stats_total["step_failures"] += 1
        log.warning("multi-step block failed (%s: %s); single steps isolate the cause", type(err).__name__, err)
        self._block_suspects = {s.request_id for s in self.scheduler.running}
        ms.inflight = None
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
        if self.events.active:
            self.events.emit(StepFailureEvent(step=self.step_index, time=time.perf_counter(),
                                              error=f"{type(err).__name__}: {err}", failed=[],
                                              num_requests=len(self.scheduler.running), num_retries=0,
                                              engine_index=self.engine_index))

    def _block_step(self, K: int, observe: bool, timer, mixed=None) -> list[RequestOutput] | None:
        """A step of pipelined multi-step decode: the next block is launched behind the in-flight one (or, with
        nothing in flight, the first: K iterations, or the mixed step `mixed` plans), whose tokens are then
        processed as one step of K tokens per request. None: the blocks raised and were dropped."""
        try:
            blk = self.multi_step.run(K, self.arrivals_pending, mixed)
        except Exception as e:  # noqa: BLE001 - single steps isolate the cause (until these requests end)
            self._block_failed(e)
            return None
        sched = blk.sched
        for seq in sched.admitted:              # newcomers prefilled in a mixed step launched behind a block
            self._emit_request("scheduled", seq)
        self._count_iteration(sum(sched.num_new_tokens) // blk.K, blk.K)
        if observe:
            new = {id(s) for s in sched.admitted}
            sched.phases = ["prefill" if id(seq) in new else "decode" for seq in sched.seqs]
            sched.total_lens = [seq.num_tokens for seq in sched.seqs]
        outputs, finished, _ = self._process_outputs(sched, blk.tokens, [None] * len(sched.seqs))
        if self.drafter is not None:          # auto-off: probes from the block's tokens (the next block runs)
            self.drafter.shadow_probe(sched.seqs)
        t_post = time.perf_counter()
        try:
            next_mask_s = self.multi_step.finish()  # a grammar block launched behind this one: masked and sampled
        except Exception as e:  # noqa: BLE001 - these tokens are processed; the next block is dropped
            next_mask_s = 0.0
            self._block_failed(e)
        t_end = time.perf_counter()
        self.step_index += 1
        if observe:
            timings = {"schedule": blk.t_scheduled - blk.t_start, "forward": blk.t_launched - blk.t_scheduled,
                       "sampling": blk.t_sample - blk.t_wait + (t_end - t_post - next_mask_s),
                       "postprocess": t_post - blk.t_sample, **timer.collect()}
            if blk.mask_s + next_mask_s:
                timings["grammar mask"] = blk.mask_s + next_mask_s
            self._emit_step(sched, blk.t_start, t_end, finished, timings, cuda_graph=blk.graphed,
                            num_decode_steps=blk.K, rank_timings=self.collect_rank_timings(), block_plan=blk.plan)
        else:
            self.block_manager.pop_step_stats()
        return outputs

    def _count_iteration(self, num_tokens: int, times: int = 1) -> None:
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += times
        self.iteration_tokens_sum += num_tokens * times

    def _process_outputs(self, sched: SchedulerOutput, new_tokens: list[list[int]], lp_rows: list
                         ) -> tuple[list[RequestOutput], list[str], int]:
        """-> (outputs, finished request ids, the step's tokens as vLLM's iteration_tokens_total counts them: the
        tokens generated, plus the whole prompt of each request that got its first token)."""
        generated = self.output_processor.num_generation_tokens
        outputs, first, finished = self.output_processor.process(sched, new_tokens, lp_rows)
        for seq in first:
            self._emit_request("first_token", seq)
        for seq in finished:
            self._finished(seq)
        num_tokens = self.output_processor.num_generation_tokens - generated + \
            sum(len(seq.prompt_token_ids) for seq in first)
        return outputs, [seq.request_id for seq in finished], num_tokens

    # ---- events --------------------------------------------------------------------------------
    def _emit_request(self, kind: str, seq: Sequence, finish_reason: str | None = None,
                      message: str | None = None) -> None:
        if self.events.active:
            self.events.emit(request_event(kind, seq, self.step_index, finish_reason, message, self.engine_index))

    def _emit_step(self, sched: SchedulerOutput, t0: float, t1: float, finished: list[str], timings: dict,
                   cuda_graph: bool = False, num_decode_steps: int = 1, rank_timings: dict | None = None,
                   block_plan: dict | None = None) -> None:
        self.events.emit(step_event(
            sched, self.step_index, t0, t1, finished,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.block_manager.usage, num_blocks=self.num_blocks, timings=timings, cuda_graph=cuda_graph,
            num_decode_steps=num_decode_steps,
            spec=self.drafter.pop_step_stats() if self.drafter is not None else None,
            memory=self.memory_stats(), timings_sampled=self.runner.pop_timing_sampled(),
            rank_timings=rank_timings, block_plan=block_plan, engine_index=self.engine_index,
            **self.block_manager.pop_step_stats(),
            **self._swap_bytes()))

    def _swap_bytes(self) -> dict:
        out, inn = self.runner.pop_swap_bytes()
        return dict(bytes_swapped_out=out, bytes_swapped_in=inn)

    # ---- introspection (read between steps by the inspector, /metrics and the benchmarks) ---------
    def stats(self) -> dict:
        bm = self.block_manager
        return dict(step=self.step_index, num_running=len(self.scheduler.running),
                    num_waiting=len(self.scheduler.waiting), num_blocks=self.num_blocks,
                    num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
                    num_preemptions_total=self.scheduler.num_preemptions, num_swaps_total=self.scheduler.num_swaps,
                    num_host_blocks=self.num_host_blocks, kv_format=str(self.runner.kv_dtype).replace("torch.", ""),
                    **self.block_manager.swap_stats,
                    prefix_cache_queries=bm.total_queries, prefix_cache_hits=bm.total_hits,
                    max_model_len=self.max_model_len, block_size=self.block_size,
                    device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
                    kernels=self.kernels, model=self.model_name, quantization=self.quantization,
                    generation_tokens=self.output_processor.num_generation_tokens, **self.stats_total,
                    iteration_tokens_counts=list(self.iteration_tokens_counts),
                    iteration_tokens_sum=self.iteration_tokens_sum,
                    tensor_parallel_size=self.config.parallel_config.tensor_parallel_size,
                    parallel_layout=self.parallel_layout,
                    **(self.drafter.total_stats() if self.drafter is not None else {}))

    def memory_stats(self) -> dict:
        """Memory now, in bytes: `allocated` / `max_allocated` from the CUDA caching allocator on a GPU (weights,
        KV pool, activations, graphs), on a CPU the engine's own tensors (weights + KV pool); `kv_pool` the
        whole KV pool; `kv_reserved` the slots of blocks held by requests; `kv_used` those holding a token."""
        reserved, used = self.block_manager.slot_usage(self.scheduler.running)
        pool = self.num_blocks * self.block_size * self.slot_bytes
        if self.device.type == "cuda":
            alloc, peak = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
        else:
            alloc = peak = self.weight_bytes + pool
        return dict(allocated=alloc, max_allocated=peak, kv_pool=pool, kv_reserved=reserved * self.slot_bytes,
                    kv_used=used * self.slot_bytes, reserved_slots=reserved, used_slots=used)

    def kv_snapshot(self) -> dict:
        pool = self.block_manager.pool
        holders = list(self.scheduler.running) + [s for s in self.scheduler.waiting if s.block_table]
        return dict(num_blocks=self.num_blocks, block_size=self.block_size, ref_counts=list(pool.ref_counts),
                    cached=[h is not None for h in pool.block_hash],
                    block_tables={s.request_id: list(s.block_table) for s in holders},
                    num_computed_tokens={s.request_id: s.num_computed_tokens for s in holders},
                    kv_cache_layout=self.config.cache_config.kv_cache_layout,
                    kv_format=str(self.runner.kv_dtype).replace("torch.", ""), host=self._host_snapshot())

    def _host_snapshot(self) -> dict | None:
        """The host tier for the block map: each host block's owner (a swapped-out request) or cached hash."""
        host = self.block_manager.host
        if host is None:
            return None
        swapped = [s for s in self.scheduler.waiting if s.host_block_table]
        return dict(num_blocks=host.num_blocks, cached=sorted(host.cached.values()),
                    block_tables={s.request_id: list(s.host_block_table) for s in swapped})

    def parallel_info(self) -> dict:
        """How the model is split over the tensor-parallel ranks (the inspector's parallel view): per rank its
        device, the [start, count] of the query heads, KV heads, MLP rows and vocabulary rows of every layer it
        holds, and its weight and KV-pool bytes."""
        from engine.distributed.sharding import shard_layout
        mcfg, tp = self.arch_config, self.config.parallel_config.tensor_parallel_size
        ex = self.executor
        devices = [str(self.device)] + (ex.devices if ex is not None else [])
        ranks = []
        for r in range(tp):
            lay = shard_layout(mcfg, tp, r)
            kv = self.num_blocks * self.block_size * 2 * mcfg.num_layers * lay.num_kv_heads * mcfg.head_dim \
                * torch.tensor([], dtype=self.dtype).element_size()
            wb = self.weight_bytes if r == 0 else (ex.worker_bytes[r - 1] if ex is not None and ex.worker_bytes else None)
            ranks.append(dict(rank=r, device=devices[r] if r < len(devices) else "?",
                              q_heads=[lay.q_start, lay.num_heads], kv_heads=[lay.kv_start, lay.num_kv_heads],
                              intermediate=[lay.i_start, lay.intermediate],
                              vocab=[lay.v_start, min(lay.vocab, max(0, mcfg.vocab_size - lay.v_start))],
                              weight_bytes=wb, kv_pool_bytes=kv))
        return dict(layout=self.parallel_layout, num_heads=mcfg.num_heads, num_kv_heads=mcfg.num_kv_heads,
                    intermediate_size=mcfg.intermediate_size, vocab_size=mcfg.vocab_size,
                    num_blocks=self.num_blocks, ranks=ranks)

    def collect_rank_timings(self) -> dict[int, dict[str, float]] | None:
        """The other ranks' forward regions of this step's timed forwards: {rank: {region: seconds}}."""
        if self.executor is None:
            return None
        ahead = self.multi_step.inflight
        return self.executor.collect_timings(keep=ahead.K if ahead is not None else 0)

    @property
    def weights_description(self) -> str:
        """The weights' format, for headers: "unquantized", "fp8", "int4 (groups of 32)", ..."""
        q = self.quantization
        if q == "int4":
            return f"int4 (groups of {self.config.model_config.int4_group_size})"
        return q or "unquantized"

    @property
    def kernels_description(self) -> str:
        """What runs the forward, for headers: the kernel family and, on the CPU, what serves a decode step (a
        decoder layer as one C++ call, or the C++ or torch decode attention between torch ops)."""
        parts = [f"{self.kernels} kernels"]
        if self.device.type == "cpu":
            if self.model.cpu_decode_layer and cpu_kernels.loaded() and self.model.decode_layer_plan():
                parts.append("C++ decode layers")
            else:
                parts.append(f"{'C++' if cpu_kernels.loaded() else 'torch'} decode attention")
        return ", ".join(parts)

    def profile_step(self) -> None:
        """Run the next step under torch.profiler; its per-kernel table lands in `last_profile`."""
        self._profile_next = True

    @property
    def profile_pending(self) -> bool:
        """A profile_step() whose step has not run yet."""
        return self._profile_next

    def _profiled_step(self) -> list[RequestOutput]:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            outs = self._step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        rows = []
        for e in prof.key_averages():
            dev_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            rows.append(dict(name=e.key, count=e.count, cpu_time_ms=e.self_cpu_time_total / 1e3,
                             device_time_ms=dev_us / 1e3))
        key = "device_time_ms" if self.device.type == "cuda" else "cpu_time_ms"
        rows.sort(key=lambda r: -r[key])
        self.last_profile = rows[:40]
        return outs

    # ---- lifecycle -----------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """Stop the tensor-parallel worker processes (nothing without tensor parallelism); the engine cannot
        step afterwards."""
        ex, self.executor = self.executor, None
        if ex is not None:
            if getattr(self, "runner", None) is not None:
                self.runner.executor = None
            ex.shutdown()

    def close(self) -> None:
        """Release the KV pool, graphs and weights now (engines otherwise wait for the garbage collector)."""
        import gc
        for seq in list(self.seqs.values()):
            self.abort_request(seq.request_id)
        if self.runner.graphs is not None:
            self.runner.graphs.release()
            self.runner.graphs = None
        self.stop_workers()
        self.multi_step.inflight = None
        self.drafter = self.fast_verify = self.output_processor.drafter = self.multi_step.drafter = None
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
        if self.runner.copy_stream is not None:
            self.runner.copy_stream.synchronize()      # its kernels write the host tier, freed below
        self.runner.kv_cache = self.runner.host_kv = self.runner.pool_blocks = self.runner.host_blocks = None
        self.model = self.runner.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
