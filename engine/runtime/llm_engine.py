"""LLMEngine: add_request / step / abort_request over the scheduler, runner, sampler and detokenizer."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from engine.worker import multi_step
from engine.core.kv_cache_manager import BlockManager
from engine.config import EngineConfig
from engine.runtime.detokenizer import Detokenizer
from engine.events import EventBus
from engine.distributed.parallel_state import SINGLE
from engine.distributed.start import parallel_layout, start_workers
from engine.runtime.input_processor import InputProcessor
from engine.runtime.introspection import Introspection
from engine.kernels.ops import get_ops, pdl_supported
from engine.worker.model_runner import ModelRunner, kv_bytes_per_block
from engine.models.config import ModelArchConfig
from engine.models.loader import build_model, load_tokenizer, resolve
from engine.runtime.output_processor import OutputProcessor
from engine.quant.linear import set_fp8_gemm, set_packed, set_tensor_cores, weight_bytes
from engine.outputs import RequestOutput
from engine.sample.sampler import SampleRow, sample
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence
from engine.runtime.step_events import StepEvents
from engine.structured.compiler import GrammarCompiler
from engine.core.sizing import derive_max_model_len, derive_num_blocks, with_device_defaults
from engine.worker.timing import NullTimer, make_timer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (EngineConfig.max_waiting_requests): retry later."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device: {name!r} requested but CUDA is not available")
    return torch.device(name)


class LLMEngine(InputProcessor, OutputProcessor, StepEvents, Introspection):
    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.device = resolve_device(config.model_config.device)
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
        self._inflight: multi_step.InFlight | None = None      # a launched multi-step block
        self.structured_overlap = config.structured_output_config.structured_overlap \
            if config.structured_output_config.structured_overlap is not None \
            else self.device.type == "cuda"                    # pipelined one-iteration blocks with grammars
        self.arrivals_pending = False      # set by EngineLoop while submitted requests wait in its inbox
        self.decode_iter_s: float | None = None     # measured seconds per decode iteration (multi_step_max_ms)
        self._last_block_done: float | None = None
        torch.manual_seed(config.model_config.seed)

        hf_cfg, weights, tok_folder = resolve(config.model_config.model)
        self.arch_config = mcfg = ModelArchConfig.from_hf(hf_cfg)
        self.model_name = config.model_config.model or "SmolLM2-135M-Instruct"
        self.max_model_len = derive_max_model_len(config, mcfg)
        spec_margin = config.speculative_config.max_speculative_tokens + 1
        gemv_max_tokens = config.kernel_config.gemv_max_tokens \
            if config.kernel_config.gemv_max_tokens is not None else (1 if self.kernels == "triton" else 0)
        pdl = config.kernel_config.enable_pdl
        if pdl is None:                     # auto: off where a decode linear takes the persistent GEMV
            from engine.kernels.gemv import persistent_linears
            pdl = not (self.kernels == "triton" and config.parallel_config.tensor_parallel_size == 1
                       and persistent_linears(mcfg, config.kernel_config.gemv_variant, self.device))
        gemv_pdl = pdl and self.kernels == "triton" and pdl_supported(self.device)
        self.executor = None
        self.parallel_layout = parallel_layout(config.parallel_config.tensor_parallel_size, self.device)
        if config.parallel_config.tensor_parallel_size > 1:
            self.executor = start_workers(config, hf_cfg, weights, self.device, self.dtype, self.kernels,
                                          self.max_model_len + spec_margin, gemv_max_tokens, gemv_pdl)
        try:
            self._build(config, hf_cfg, weights, tok_folder, mcfg, spec_margin, gemv_max_tokens, gemv_pdl)
        except BaseException:
            self.stop_workers()
            raise

    def _build(self, config: EngineConfig, hf_cfg: dict, weights, tok_folder, mcfg: ModelArchConfig,
               spec_margin: int, gemv_max_tokens: int, gemv_pdl: bool) -> None:
        ex = self.executor
        fp8_act = config.kernel_config.fp8_activations and self.kernels == "triton" and self.device.type == "cuda" \
            and torch.cuda.get_device_capability(self.device) >= (8, 9)
        self.model = build_model(hf_cfg, weights, self.ops, self.device, self.dtype,
                                 max_pos=self.max_model_len + spec_margin, seed=config.model_config.seed,
                                 tp=ex.tp if ex is not None else SINGLE,
                                 quantization=config.model_config.quantization, fp8_activations=fp8_act,
                                 int4_group_size=config.model_config.int4_group_size)
        self.quantization = self.model.quantization      # the config's, or the checkpoint's (detected)
        tc = config.kernel_config.quant_gemv_tensor_cores
        if tc is None and not (self.kernels == "triton" and self.device.type == "cuda"
                               and torch.cuda.get_device_capability(self.device) >= (8, 0)):
            tc = False
        self.quant_tensor_cores = tc            # None: per shape, where the sweep found tensor cores faster
        pk = config.kernel_config.quant_gemv_packed
        if pk is None:
            pk = self.kernels == "triton" and self.device.type == "cuda" \
                and torch.cuda.get_device_capability(self.device) >= (9, 0)
        self.quant_packed = bool(pk) and self.kernels == "triton"
        if self.model.quantization:
            set_packed(self.model, self.quant_packed, config.kernel_config.quant_gemm_group_dots)
        set_tensor_cores(self.model, tc)
        set_fp8_gemm(self.model, config.kernel_config.fp8_gemm)   # the fp8 layers that quantize activations (fp8_act)
        self.weight_summary = weight_bytes(self.model)   # bytes by dtype and per layer (the inspector shows it)
        self.model.gemv_max_tokens, self.model.gemv_pdl = gemv_max_tokens, gemv_pdl
        self.model.set_kernel_options(config)
        if ex is not None:
            ex.wait_loaded()
        self.tokenizer = load_tokenizer(tok_folder)
        self.num_blocks = derive_num_blocks(config, self.model.cfg, self.device, self.dtype)   # this rank's heads
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
        self.block_manager = BlockManager(self.num_blocks, config.cache_config.block_size, prefix, reserve)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(self.model, mcfg, config, self.device, self.dtype, self.num_blocks,
                                  self.max_model_len + spec_margin)
        if ex is not None:
            ex.send("cache", self.num_blocks, self.max_model_len + spec_margin)
            self.runner.executor = ex
        self.runner.warmup()
        if ex is not None:
            ex.send("warmup")
        self.slot_bytes = kv_bytes_per_block(mcfg, 1, self.dtype)     # K and V of one token, all layers
        self.weight_bytes = sum(t.numel() * t.element_size() for t in
                                itertools.chain(self.model.parameters(), self.model.buffers()))
        self.detok = Detokenizer(self.tokenizer)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, mcfg.vocab_size, self.eos_token_ids)
        self.token_bitmask = None               # structured.bitmask.TokenBitmask, made for the first constraint
        self.num_constrained = 0                # unfinished requests with a grammar (0: no mask work at all)
        self.events = EventBus()
        self.generator = torch.Generator(device=self.device).manual_seed(config.model_config.seed)
        self.seqs: dict[str, Sequence] = {}
        self.step_index = 0
        self._ids = itertools.count()
        self._timer = make_timer(True, self.device) if config.observability_config.enable_step_timings else NullTimer()
        self._profile_next = False
        self.final_outputs_only = False        # LLM.generate: skip building per-step streaming outputs
        self.last_profile: list[dict] | None = None
        self.stats_total = dict(prompt_tokens=0, generation_tokens=0, finished=0, aborted=0)
        self.drafter = self.fast_verify = None
        if config.speculative_config.speculative_method:
            from engine.spec import FastVerify, make_drafter
            self.drafter = make_drafter(self)
            self.fast_verify = FastVerify(self)
        if self.device.type == "cuda" and config.kernel_config.enable_cuda_graphs and self.kernels == "triton":
            from engine.worker.cuda_graphs import CudaGraphRunner
            self.runner.graphs = CudaGraphRunner(self.runner, config)
            if ex is not None:
                ex.send("capture")                  # every rank captures the same graphs, collectives included
            self.runner.graphs.capture()

    # ---- requests ------------------------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> str:
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id: {seq.request_id!r} is already in use")
        limit = self.config.scheduler_config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            self._emit_req("rejected", seq, message="waiting queue full")
            raise EngineOverloaded(f"max_waiting_requests: the waiting queue is full ({limit} requests)")
        self.detok.start(seq)
        self.seqs[seq.request_id] = seq
        if seq.matcher is not None:
            self.num_constrained += 1
        seq.metrics.queued_time = time.perf_counter()
        self.scheduler.add(seq)
        self.stats_total["prompt_tokens"] += seq.num_prompt_tokens
        self._emit_req("arrived", seq)
        return seq.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int | None = None) -> str:
        if priority is not None and (params is None or isinstance(params, SamplingParams)):
            params = dataclasses.replace(params or SamplingParams(), priority=priority)   # SamplingParams.priority
        return self.add_sequence(self.make_sequence(prompt, params, request_id, arrival_time))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        if seq.matcher is not None:
            self.num_constrained -= 1
        seq.metrics.finished_time = time.perf_counter()
        self.stats_total["aborted"] += 1
        self._emit_req("aborted", seq, finish_reason="abort")
        return self._make_output(seq, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
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
        if self.drafter is not None and self._inflight is None:     # (a multi-step block in flight: all off)
            self.drafter.propose(self.scheduler.running)
        if self._inflight is not None and all(s.is_finished for s in self._inflight.sched.seqs):
            self._inflight = None               # every request of the in-flight block ended (aborts, stops)
        K = multi_step.plan(self) if self._inflight is None and (self.num_scheduler_steps > 1 or (
            self.num_constrained and self.structured_overlap)) else 0
        if K or self._inflight is not None:
            return multi_step.step(self, K, observe, timer)
        sched = self.scheduler.schedule()
        t_sched = time.perf_counter()
        now = t_sched
        for seq in sched.preempted:
            self._emit_req("preempted", seq)
        for seq in sched.admitted:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            self._emit_req("scheduled", seq)
        if sched.is_empty:
            if observe and sched.preempted:
                self._emit_step(sched, t0, time.perf_counter(), [], {"schedule": t_sched - t0})
            return []

        if observe:
            sched.phases = [self._phase(seq, n - k, start) for seq, n, start, k in
                            zip(sched.seqs, sched.num_new_tokens, sched.computed_before, sched.num_spec_tokens)]
            sched.total_lens = [seq.num_tokens for seq in sched.seqs]
        sample_mask = [start + n == seq.num_tokens + len(seq.spec_token_ids)
                       for seq, n, start in zip(sched.seqs, sched.num_new_tokens, sched.computed_before)]
        extra = [k for k in sched.num_spec_tokens] if self.drafter is not None else None
        decode_only = self.drafter is not None and all(       # auto-off measures decode-only step times
            seq.num_output_tokens and start == seq.num_tokens - 1 and n == k + 1
            for seq, n, start, k in zip(sched.seqs, sched.num_new_tokens, sched.computed_before, sched.num_spec_tokens))
        fast = self.fast_verify.plan(sched) if self.fast_verify is not None else None
        if fast is not None:        # plain-greedy verify step: padded graph layout packed directly, argmax ids back
            graphed = self.fast_verify.launch(sched, fast)
            t_prep = t_fwd = time.perf_counter()
        else:
            input_ids, md = self.runner.prepare(sched, sample_mask, extra)
            t_prep = time.perf_counter()
            logits = self.runner.execute(input_ids, md)
            if self.drafter is not None and not decode_only:    # while the prefill runs on the device
                self.drafter.prefetch(sched)
            t_fwd, graphed = time.perf_counter(), md.graphed
        constrained = self.num_constrained > 0
        if constrained:             # on CUDA the host fills the masks while the forward runs
            rows = []                                   # the sequence whose next token each logits row samples
            for i, (seq, m) in enumerate(zip(sched.seqs, sample_mask)):
                if m:
                    rows += [seq] + [None] * (extra[i] if extra else 0)
            self._apply_grammars(rows, logits)
        t_mask = time.perf_counter()
        num_spec = max(sched.num_spec_tokens, default=0)
        if fast is not None:
            outputs_tokens, lp_rows = self.drafter.verify_greedy(sched, self.fast_verify.targets(), fast[1])
        elif num_spec:
            outputs_tokens, lp_rows = self.drafter.verify(sched, sample_mask, logits)
        else:                                           # no drafts this step: a plain step
            outputs_tokens, lp_rows = self._sample(sched, sample_mask, logits)
        t_sample = time.perf_counter()
        if self.executor is not None:
            self.executor.check()               # a rank that died mid-step leaves these tokens meaningless
        outputs, finished = self._postprocess(sched, sample_mask, outputs_tokens, lp_rows)
        if self.drafter is not None:
            self.drafter.shadow_probe(sched.seqs)
        t_end = time.perf_counter()
        self.step_index += 1
        if self.config.scheduler_config.multi_step_max_ms and sched.num_tokens == len(sched.seqs):
            multi_step.observe_iteration(self, t_end - t0)        # a decode-only step: one iteration
        if decode_only and (num_spec or self.num_scheduler_steps == 1):     # (multi-step: a block's iteration)
            self.drafter.observe_step(len(sched.seqs), num_spec, t_end - t0)
        if observe:
            timings = {"schedule": t_sched - t0, "prepare": t_prep - t_sched, "forward": t_fwd - t_prep,
                       "sampling": t_sample - t_mask, "postprocess": t_end - t_sample}
            if constrained:
                timings["grammar mask"] = t_mask - t_fwd
            timings.update({k: v for k, v in timer.collect().items()})
            self._emit_step(sched, t0, t_end, finished, timings, cuda_graph=graphed,
                            rank_timings=self.collect_rank_timings())
        else:
            self.block_manager.pop_step_stats()
        return outputs

    def _sample(self, sched: SchedulerOutput, sample_mask: list[bool], logits: torch.Tensor):
        rows, seqs = [], []
        for seq, m in zip(sched.seqs, sample_mask):
            if m:
                seqs.append(seq)
                rows.append(self._sample_row(seq))
        if not rows:
            return [[] for _ in sched.seqs], [None] * len(sched.seqs)
        tokens, logprobs = sample(logits, rows, self.generator, fused=self.fused_sampling)
        out_tokens, out_lp = [], []
        j = 0
        for m in sample_mask:
            if m:
                out_tokens.append([tokens[j]])
                out_lp.append(None if logprobs is None else [logprobs[j]])
                j += 1
            else:
                out_tokens.append([])
                out_lp.append(None)
        return out_tokens, out_lp

    def _apply_grammars(self, row_seqs: list[Sequence | None], logits: torch.Tensor) -> None:
        """-inf on the logits of tokens a constrained request's grammar forbids next. row_seqs[r]: the
        sequence whose next token logits row r samples (None: a draft position). Constrained requests get no
        drafts, so each has one logits row."""
        rows = [r for r, seq in enumerate(row_seqs) if seq is not None and seq.matcher is not None
                and not (seq.matcher.is_stopped() or seq.matcher.is_error())]   # (ended inside a grammar block)
        if not rows:
            return
        self.token_bitmask_for_grammars().apply(logits, [row_seqs[r].matcher for r in rows], rows)

    def token_bitmask_for_grammars(self):
        if self.token_bitmask is None:
            from engine.structured.bitmask import TokenBitmask
            self.token_bitmask = TokenBitmask(self.grammar_compiler.mask_vocab_size, self.device,
                                              fused=self.config.structured_output_config.fused_token_bitmask
                                              and self.kernels == "triton",
                                              threads=self.config.structured_output_config.structured_mask_threads)
        return self.token_bitmask

    def _sample_row(self, seq: Sequence, extra_tokens: list[int] | None = None) -> SampleRow:
        p = seq.params
        toks = seq.token_ids + extra_tokens if extra_tokens else seq.token_ids
        n_out = len(toks) - seq.num_prompt_tokens
        banned = None
        if n_out < p.min_tokens and seq.matcher is None:     # a grammar alone decides when it may end
            banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        return SampleRow(p, toks if p.needs_penalties else [], seq.num_prompt_tokens, n_out, banned)

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
        self.stop_workers()
        self.runner.graphs = None
        self._inflight = None
        self.drafter = self.fast_verify = None  # a draft model and its KV pool go with it
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
        self.runner.kv_cache = None
        self.model = self.runner.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
