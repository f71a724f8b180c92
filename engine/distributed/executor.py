"""Rank 0's side of tensor parallelism: start one worker process per extra rank, send each step's plan to
them, watch that they stay alive, and stop them.

A step goes out as a small header over each worker's pipe (shapes and the host-side lengths) and one
broadcast of its packed int64 tensors over the process group, so multi-step decoding can feed the ranks
tokens that are still on rank 0's device. Every rank then runs the same forward; the collectives inside it
keep the ranks in step.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import wait

import torch

from engine.distributed.parallel_state import TensorParallel, abort_group, init_group
from engine.distributed.worker import worker_main

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600        # a worker builds its shard within this (70B-shape dummy weights take a while)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed: the engine must be restarted."""


class TPExecutor:
    def __init__(self, size: int, device: torch.device, args: dict):
        if torch.distributed.is_initialized():
            raise ValueError("EngineConfig.tensor_parallel_size: another tensor-parallel engine is running in "
                             "this process; close it first (LLMEngine.close)")
        self.size, self.device = size, device
        self.closing = False
        self.failure: str | None = None
        self.pending_timings = 0
        ctx = mp.get_context("spawn")         # CUDA cannot be used in a forked child
        store = torch.distributed.TCPStore("127.0.0.1", 0, size, True,
                                           timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
                                           wait_for_workers=False)
        self.procs, self.conns = [], []
        # the server's engine-core process is daemonic, and multiprocessing refuses children there; the
        # workers stop with their parent anyway (worker._watch_parent, and shutdown() here)
        me = mp.current_process()
        daemonic = me._config.get("daemon", False)
        me._config["daemon"] = False
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(rank, size, store.port, args, child), daemon=True,
                                name=f"kvscope-tp-rank{rank}")
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        finally:
            me._config["daemon"] = daemonic
        try:
            self._expect("joining")
            self.tp: TensorParallel = init_group(0, size, store, device)
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="kvscope-tp-watch", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- liveness ------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A worker that dies mid-collective would leave rank 0 waiting in NCCL: abort the group so it returns
        (gloo fails by itself when the peer's socket closes)."""
        wait([p.sentinel for p in self.procs])
        if self.closing:
            return
        self._note_dead()
        if self.tp.backend == "nccl":
            abort_group(force=True)

    def _note_dead(self) -> None:
        for rank, p in enumerate(self.procs, 1):
            if not p.is_alive() and self.failure is None:
                reason = self._worker_error(rank - 1)
                self.failure = (f"tensor parallel: rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                                + (f": {reason}" if reason else "") + "; restart the engine")

    def _worker_error(self, i: int) -> str | None:
        try:
            while self.conns[i].poll(0):
                msg = self.conns[i].recv()
                if msg[0] == "error":
                    return msg[1].strip().splitlines()[-1]
        except (EOFError, OSError):
            pass
        return None

    def check(self) -> None:
        """Raise RankFailure when a worker is gone."""
        if self.failure is None and not all(p.is_alive() for p in self.procs):
            self._note_dead()
        if self.failure is not None:
            raise RankFailure(self.failure)

    def explain(self, err: BaseException) -> BaseException:
        """A collective's error -> RankFailure naming the dead rank (it may take a moment to be reaped)."""
        if isinstance(err, RankFailure):
            return err
        for p in self.procs:
            p.join(timeout=2.0)
            if not p.is_alive():
                break
        self._note_dead()
        if self.failure is None:
            self.failure = f"tensor parallel: a collective failed ({err}); restart the engine"
        return RankFailure(self.failure)

    def _expect(self, kind: str) -> None:
        """Wait for every worker's `kind` message, failing at once when one dies instead."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for i, (p, c) in enumerate(zip(self.procs, self.conns)):
            while not c.poll(0.2):
                if not p.is_alive():
                    self.check()
                if time.monotonic() > deadline:
                    raise RankFailure(f"tensor parallel: rank {i + 1} sent no {kind!r} in {JOIN_TIMEOUT_S} s")
            try:
                msg = c.recv()
            except EOFError as e:
                raise self.explain(e) from e
            if msg[0] == "error":
                raise RankFailure(f"tensor parallel: rank {i + 1} failed: {msg[1].strip().splitlines()[-1]}")
            if msg[0] != kind:
                raise RankFailure(f"tensor parallel: rank {i + 1} sent {msg[0]!r}, expected {kind!r}")

    # ---- messages ------------------------------------------------------------------------------
    def send(self, *msg) -> None:
        self.check()
        try:
            for c in self.conns:
                c.send(msg)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise self.explain(e) from e

    def wait_loaded(self) -> None:
        self._expect("loaded")

    def launch(self, input_ids: torch.Tensor, md, timed: bool) -> None:
        """Send one forward's plan: the header, then a broadcast of [ids | positions | slots | logits idx |
        cu_seqlens_q | seq_lens | block tables] (int64, rank 0's device tensors)."""
        B, W = md.block_tables.shape
        header = (input_ids.shape[0], B, W, md.logits_indices.shape[0], md.q_lens, md.seq_lens_cpu,
                  md.max_seqlen_q, md.max_seqlen_k)
        self.send("exec", header, timed)
        self.pending_timings += timed
        buf = torch.cat([input_ids, md.positions, md.slot_mapping, md.logits_indices, md.cu_seqlens_q.long(),
                         md.seq_lens.long(), md.block_tables.reshape(-1).long()])
        self.tp.broadcast(buf)

    def collect_timings(self, keep: int = 0) -> dict[int, dict[str, float]]:
        """{rank: {region: seconds}} summed over the timed forwards sent so far, but the last `keep` (a
        multi-step block still in flight: its timings belong to the next step)."""
        n = max(0, self.pending_timings - keep)
        self.pending_timings -= n
        out: dict[int, dict[str, float]] = {}
        if not n:
            return out
        for rank, c in enumerate(self.conns, 1):
            acc: dict[str, float] = {}
            for _ in range(n):
                if not c.poll(30.0):
                    raise self.explain(TimeoutError(f"rank {rank} sent no step timings"))
                msg = c.recv()
                if msg[0] != "timings":
                    raise self.explain(RuntimeError(f"rank {rank}: {msg[0]}"))
                for k, v in msg[1].items():
                    acc[k] = acc.get(k, 0.0) + v
            out[rank] = acc
        return out

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and leave the process group; no process stays behind."""
        self.closing = True
        for c in self.conns:
            try:
                c.send(("close",))
            except Exception:
                pass
        # leave the group while the workers leave it too (an NCCL teardown may wait for its peers)
        abort_group(force=self.failure is not None)
        for p in self.procs:
            p.join(timeout=10.0)
            if p.is_alive():
                log.warning("tensor parallel: rank %s did not stop; terminating", p.name)
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
