"""Data parallelism (vLLM's --data-parallel-size): N engine replicas, each an engine process on its own GPU
(or tensor-parallel group of GPUs), behind one API server. The router sends each request to the replica that
already holds the longest cached prefix of its prompt, unless that replica is much busier than the least
loaded one; otherwise to the least loaded (open requests).

Which replica holds which prefix is known here without asking the engines: the router remembers the chained
block keys (core/kv_cache_manager.prompt_block_hashes) of the prompts it sent to each replica, least recently
used first out, as many as the replicas' KV pools hold. A replica may have evicted a block since; it then
recomputes it, as a cache miss does anywhere.
"""
from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict

import torch

from engine.config import EngineConfig
from engine.core.kv_cache_manager import prompt_block_hashes
from engine.distributed.launch import env_launch
from engine.runtime.async_engine import EngineLoop, RequestStream
from engine.runtime.core_client import EngineCoreClient


# stats that add up over replicas (the rest are the same on every replica, or replica 0's)
ADDITIVE = ("num_running", "num_waiting", "num_blocks", "num_free_blocks", "num_preemptions_total",
            "prompt_tokens", "generation_tokens", "finished", "aborted", "prefix_cache_queries", "prefix_cache_hits",
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def replica_device(device: str, replica: int, tp: int) -> str:
    """Replica r's first device: cuda:base + r * tensor_parallel_size; every replica on the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + replica * tp}"


class PrefixRouter:
    """Least-loaded routing with prefix affinity. loads: each replica's open requests; equally loaded replicas take
    turns, so that requests one after another (or from API servers that each see only their own) spread."""

    def __init__(self, num_replicas: int, block_size: int, capacity: int, imbalance: int):
        self.n, self.block_size, self.capacity = num_replicas, block_size, capacity
        self.imbalance = imbalance      # open requests a prefix-holding replica may have beyond the least loaded
        self.owner: OrderedDict[int, int] = OrderedDict()      # block key -> replica that computed it last
        self.prefix_routed = 0          # requests sent where their prefix was cached
        self._next = 0                  # equally loaded replicas take turns from here

    def route(self, token_ids: list[int], loads: list[int]) -> int:
        hashes = prompt_block_hashes(token_ids, self.block_size)
        least = min(range(self.n), key=lambda r: (loads[r], (r - self._next) % self.n))
        self._next = (least + 1) % self.n
        best = least
        for h in reversed(hashes):      # the longest cached prefix: its last block's key names the replica
            r = self.owner.get(h)
            if r is not None:
                if loads[r] <= loads[least] + self.imbalance:
                    best = r
                    self.prefix_routed += 1
                break
        for h in hashes:
            self.owner[h] = best
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)
        return best


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """Each replica's config: one engine (data_parallel_size 1) on its own device(s)."""
    n, tp = config.parallel_config.data_parallel_size, config.parallel_config.tensor_parallel_size
    if env_launch() is not None:
        raise ValueError("EngineConfig.data_parallel_size: replicas start their own processes; under torchrun "
                         "(RANK / WORLD_SIZE set) run one replica per launch")
    configs = [config.replace(data_parallel_size=1, device=replica_device(config.model_config.device, r, tp))
               for r in range(n)]
    if configs[0].model_config.device.startswith("cuda") and n * tp > torch.cuda.device_count():
        raise ValueError(f"EngineConfig.data_parallel_size: {n} replicas x tensor_parallel_size {tp} need "
                         f"{n * tp} CUDA devices from {configs[0].model_config.device}, this machine has "
                         f"{torch.cuda.device_count()}")
    return configs


class DPEngineClient:
    """The serving surface of EngineCoreClient (submit_many, abort, stats, metrics_snapshot, healthy,
    shutdown, engine) over `data_parallel_size` engine processes: started here, or (`replicas`) clients
    attached to engine processes that another process started (several API server processes), or in-process
    EngineLoops (dp_loop.DPEngineLoop). A replica needs: engine, num_open, submit_sequences, abort,
    metrics_snapshot, healthy, error, shutdown."""

    def __init__(self, config: EngineConfig | None = None, start_timeout: float = 900.0,
                 replicas: list[EngineCoreClient] | None = None, **overrides):
        config = EngineConfig.of(config, **overrides)
        self.requested_config = config
        if replicas is not None:
            self.replicas: list[EngineCoreClient | None] = list(replicas)
        else:
            self.replicas = self._start(replica_configs(config), start_timeout)
        self.engine = self.replicas[0].engine         # validation and tokenization: the same model everywhere
        sc = self.engine.config.scheduler_config
        self.router = PrefixRouter(len(self.replicas), self.engine.block_size,
                                   capacity=sum(r.engine.num_blocks for r in self.replicas),
                                   imbalance=max(1, sc.max_num_seqs // 4))
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:8]     # unnamed requests: unique across the clients of the replicas
        self._stop = False

    def _start(self, configs: list[EngineConfig], start_timeout: float) -> list[EngineCoreClient]:
        """An engine process per replica config, started side by side."""
        self.replicas = [None] * len(configs)
        from transformers import AutoTokenizer  # noqa: F401 - its lazy import is not thread-safe: once, here
        errors: list[BaseException] = []

        def start(r: int) -> None:
            try:
                self.replicas[r] = EngineCoreClient(configs[r], start_timeout=start_timeout)
            except BaseException as e:  # noqa: BLE001 - reported below, after every start has ended
                errors.append(e)
        threads = [threading.Thread(target=start, args=(r,), name=f"kvscope-dp-start{r}") for r in range(len(configs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.shutdown()
            raise errors[0]
        return self.replicas

    @property
    def config(self) -> EngineConfig:
        return self.engine.config.replace(data_parallel_size=len(self.replicas))

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r is not None and r.error is not None), None)

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas if r is not None)

    def start(self) -> "DPEngineClient":
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def healthy(self) -> bool:
        return not self._stop and all(r.healthy() for r in self.replicas)

    # ---- requests --------------------------------------------------------------------------------
    submit = EngineLoop.submit
    generate = EngineLoop.generate

    def submit_many(self, requests: list[tuple], arrival_time: float | None = None) -> list[RequestStream]:
        """Validate all, route each, then hand each replica its share in one message. A replica that refuses
        its share (a full queue) leaves none of the batch queued anywhere."""
        import time
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        if self._stop:
            raise RuntimeError("engine shut down")
        seqs = [self.engine.make_sequence(p, sp, rid if rid is not None else "pending", arrival)
                for p, sp, rid in requests]
        rids = [rid if rid is not None else f"dp-{self._id_prefix}-{next(self._ids)}" for _, _, rid in requests]
        with self._lock:
            loads = [r.num_open for r in self.replicas]
            groups: dict[int, list[int]] = {}
            for i, seq in enumerate(seqs):
                r = self.router.route(seq.prompt_token_ids, loads)
                loads[r] += 1
                groups.setdefault(r, []).append(i)
            out: list[RequestStream | None] = [None] * len(seqs)
            done: list[RequestStream] = []
            try:
                for r, idx in groups.items():
                    for i in idx:
                        seqs[i].request_id = rids[i]
                    streams = self.replicas[r].submit_sequences([seqs[i] for i in idx], [rids[i] for i in idx])
                    for i, st in zip(idx, streams):
                        out[i] = st
                    done += streams
            except BaseException:
                for st in done:
                    st.loop.abort(st.request_id)
                raise
        return out  # type: ignore[return-value]

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            r.abort(request_id)             # a no-op where the request is not open

    # ---- state -----------------------------------------------------------------------------------
    def replica_stats(self) -> list[dict]:
        """Each replica's latest stats (its /metrics series, labelled engine="0", "1", ...), without waiting for
        a step in progress."""
        return [r.metrics_snapshot() for r in self.replicas]

    def stats(self) -> dict:
        """Replica 0's stats with the counters summed over the replicas (KV usage: the mean), the per-replica
        stats under "replicas"."""
        per = self.replica_stats()
        total = dict(per[0])
        for k in ADDITIVE:
            if all(k in s for s in per):
                total[k] = sum(s[k] for s in per)
        total["kv_usage"] = sum(s.get("kv_usage", 0.0) for s in per) / len(per)
        total["parallel_layout"] = f"DP={len(per)} × {per[0].get('parallel_layout', '')}"
        total.update(data_parallel_size=len(per), prefix_routed=self.router.prefix_routed, replicas=per)
        return total

    metrics_snapshot = stats

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        threads = [threading.Thread(target=r.shutdown, args=(timeout,)) for r in self.replicas if r is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
