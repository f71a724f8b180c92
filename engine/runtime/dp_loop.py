"""Data parallelism in one process: an EngineLoop per replica (each LLMEngine on its own thread and device) behind
DPEngineClient's router. The app runs its replicas this way, so that its inspector can subscribe to every replica's
events (each tagged with the replica's engine_index); the API server runs them as engine processes instead.
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.runtime.async_engine import EngineLoop
from engine.runtime.dp_client import DPEngineClient, replica_configs
from engine.runtime.llm_engine import LLMEngine


class DPEngineLoop(DPEngineClient):
    """EngineLoop's surface (submit, abort, stats, kv_snapshot, profile_step, start, shutdown) over
    `data_parallel_size` in-process replicas; `engine` is replica 0's (validation and tokenization)."""

    restarts = 0                        # an in-process replica is never restarted

    def __init__(self, config: EngineConfig | None = None, **overrides):
        config = EngineConfig.of(config, **overrides)
        n, tp = config.parallel_config.data_parallel_size, config.parallel_config.tensor_parallel_size
        if tp > 1:
            # torch.distributed holds one default process group per process: one tensor-parallel engine
            raise ValueError(f"EngineConfig.tensor_parallel_size: in-process data-parallel replicas need 1 (got {tp} "
                             f"with data_parallel_size {n}); run tensor-parallel replicas behind the API server "
                             "(--data-parallel-size)")
        loops: list[EngineLoop] = []
        try:
            for r, cfg in enumerate(replica_configs(config)):
                loops.append(EngineLoop(cfg, engine_index=r))
        except BaseException:
            for lp in loops:
                lp.shutdown()
            raise
        super().__init__(config, replicas=loops)

    @property
    def engines(self) -> list[LLMEngine]:
        """Each replica's engine, by engine_index."""
        return [r.engine for r in self.replicas]

    def start(self) -> "DPEngineLoop":
        for r in self.replicas:
            r.start()
        return self

    def __enter__(self):
        return self.start()

    def kv_snapshot(self) -> dict:
        """Each replica's kv_snapshot(), by engine_index, under "replicas"."""
        return dict(replicas=[r.kv_snapshot() for r in self.replicas])

    def profile_step(self, timeout: float = 60.0) -> list[dict] | None:
        """Profile the next step of the replica with the most open requests."""
        return max(self.replicas, key=lambda r: r.num_open).profile_step(timeout)
