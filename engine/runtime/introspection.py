"""Introspection of LLMEngine: counters, memory, the KV block map, other ranks' timings and the per-kernel
profiler, read between steps by the inspector, the server's /metrics and the benchmarks."""
from __future__ import annotations

import torch

from engine.outputs import RequestOutput


class Introspection:
    """Mixed into LLMEngine; reads its scheduler, block manager, drafter and executor."""

    def stats(self) -> dict:
        bm = self.block_manager
        return dict(step=self.step_index, num_running=len(self.scheduler.running),
                    num_waiting=len(self.scheduler.waiting), num_blocks=self.num_blocks,
                    num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
                    num_preemptions_total=self.scheduler.num_preemptions,
                    prefix_cache_queries=bm.total_queries, prefix_cache_hits=bm.total_hits,
                    max_model_len=self.max_model_len, block_size=self.block_size,
                    device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
                    kernels=self.kernels, model=self.model_name, quantization=self.quantization,
                    **self.stats_total,
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
                    kv_cache_layout=self.config.cache_config.kv_cache_layout)

    def collect_rank_timings(self) -> dict[int, dict[str, float]] | None:
        """The other ranks' forward regions of this step's timed forwards: {rank: {region: seconds}}."""
        if self.executor is None:
            return None
        ahead = self._inflight
        return self.executor.collect_timings(keep=ahead.K if ahead is not None else 0)

    def profile_step(self) -> None:
        """Run the next step under torch.profiler; its per-kernel table lands in `last_profile`."""
        self._profile_next = True

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
