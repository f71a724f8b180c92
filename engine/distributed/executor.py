"""Rank 0's side of tensor parallelism: start (or, under torchrun, wait for) one worker per extra rank, send
each step's plan to them, watch that they stay alive, and stop them.

A step goes out as a small header over each worker's control connection (shapes, the host-side lengths, and
whether the forward replays a CUDA graph: every rank must run the same collectives) and one broadcast of its
packed int64 tensors over the process group, so multi-step decoding can feed the ranks tokens that are still
on rank 0's device. Every rank then runs the same forward; the collectives inside it keep the ranks in step.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path

import torch

from engine.distributed.launch import JOIN_TIMEOUT_S, EnvLaunch, control_listener, open_store
from engine.ipc import set_nodelay
from engine.distributed.parallel_state import TensorParallel, abort_group, init_group, rank_device
from engine.distributed.worker import PARENT_ENV, packed_sizes, recv, send

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0       # a worker that has not left this long after "close" is terminated
STDERR_TAIL = 40            # lines of a spawned worker's stderr kept for the error that reports its death


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed: the engine must be restarted."""


class _Spawned:
    """A worker process rank 0 started: its handle and the tail of its stderr (echoed to ours as it comes)."""

    def __init__(self, rank: int, env: dict):
        root = str(Path(__file__).resolve().parents[2])
        env = {**env, "PYTHONPATH": root + os.pathsep + env.get("PYTHONPATH", "")}
        self.rank = rank
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.distributed.worker_main"], env=env,
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._reader = threading.Thread(target=self._read, name=f"kvscope-tp-stderr{rank}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(f"[rank {self.rank}] {line}")

    def stderr_tail(self) -> str:
        self._reader.join(timeout=1.0)          # the pipe closes with the process: read what it left
        return "\n".join(self.tail)


class TPExecutor:
    def __init__(self, size: int, device: torch.device, args: dict, launch: EnvLaunch | None = None):
        if torch.distributed.is_initialized():
            raise ValueError("EngineConfig.tensor_parallel_size: another tensor-parallel engine is running in "
                             "this process; close it first (LLMEngine.close)")
        if launch is not None and launch.world_size != size:
            raise ValueError(f"EngineConfig.tensor_parallel_size: {size}, but the launcher started "
                             f"WORLD_SIZE={launch.world_size} ranks; they must be equal")
        self.size, self.device, self.env = size, device, launch
        self.closing = False
        self.failure: str | None = None
        self._dead_lock = threading.Lock()
        self.pending_timings = 0
        self.spawned: list[_Spawned] = []
        self.conns: list = [None] * (size - 1)
        self.peers: list[tuple] = [None] * (size - 1)      # (local_rank, pid, host) of ranks 1..N-1
        self.worker_bytes: list[int] = []                  # weight bytes of ranks 1..N-1
        self.devices: list[str] = []                       # devices of ranks 1..N-1
        store = open_store(launch, size)
        listener = control_listener(store, launch)
        try:
            if launch is None:
                base = dict(os.environ, WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                            **{PARENT_ENV: str(os.getpid())})
                base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
                for rank in range(1, size):
                    self.spawned.append(_Spawned(rank, dict(base, RANK=str(rank), LOCAL_RANK=str(rank))))
            self._accept(listener)
            for i, c in enumerate(self.conns):
                local_rank = self.peers[i][0]
                dev = rank_device(device, i + 1) if launch is None else \
                    (torch.device("cuda", local_rank) if device.type == "cuda" else device)
                self.devices.append(f"{dev}" + (f" on {self.peers[i][2]}" if launch is not None else ""))
                send(c, "args", dict(args, device=str(dev)))
            self.tp: TensorParallel = init_group(0, size, store, device,
                                                  not args["config"]["disable_custom_all_reduce"])
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()
        self._watcher = threading.Thread(target=self._watch, name="kvscope-tp-watch", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p[1] for p in self.peers if p is not None]

    def _accept(self, listener) -> None:
        """Each worker connects and says its rank; fail at once when a spawned one dies first."""
        accepted: list = []

        def accept():
            try:
                for _ in range(self.size - 1):
                    conn = listener.accept()
                    set_nodelay(conn)
                    accepted.append(conn)
            except OSError:             # closed: start-up failed
                pass
        t = threading.Thread(target=accept, name="kvscope-tp-accept", daemon=True)
        t.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while t.is_alive():
            t.join(0.1)
            for s in self.spawned:
                if s.proc.poll() is not None:
                    raise RankFailure(self._death(s.rank))
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor parallel: {self.size - 1 - len(accepted)} worker(s) did not connect in "
                                  f"{JOIN_TIMEOUT_S} s")
        for c in accepted:
            kind, rank, local_rank, pid, host = recv(c)
            if kind != "joining" or not 1 <= rank < self.size or self.conns[rank - 1] is not None:
                raise RankFailure(f"tensor parallel: unexpected hello {kind!r} from rank {rank}")
            self.conns[rank - 1], self.peers[rank - 1] = c, (local_rank, pid, host)

    # ---- liveness ------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A worker's control connection closes when its process ends, however it ends: note which rank died and
        abort the group, so a collective waiting on it (NCCL would wait out its timeout) returns now."""
        socks = [socket.socket(fileno=os.dup(c.fileno())) for c in self.conns]
        try:
            while not self.closing:
                ready = wait(socks, timeout=0.5)
                dead = [i for i, s in enumerate(socks) if s in ready and _closed(s)]
                if dead and not self.closing:
                    self._note_dead(dead[0] + 1)
                    abort_group(force=True)
                    return
                if ready:
                    time.sleep(0.05)    # a message waits for the engine thread to read it
        finally:
            for s in socks:
                s.close()

    def _death(self, rank: int) -> str:
        """What is known of a dead rank: exit code and error (spawned), or that its connection closed."""
        local_rank, pid, host = self.peers[rank - 1] or (None, None, None)
        reason = self._worker_error(rank)
        sp = next((s for s in self.spawned if s.rank == rank), None)
        if sp is not None:
            try:
                code = sp.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                code = None
            what = f"tensor parallel: rank {rank} (pid {sp.proc.pid}) exited with code {code}"
            tail = sp.stderr_tail()
            if reason is None and tail:
                reason = tail.strip().splitlines()[-1]
            msg = what + (f": {reason}" if reason else "") + "; restart the engine"
            return msg + (f"\n--- rank {rank} stderr (last lines) ---\n{tail}" if tail else "")
        where = f"pid {pid} on {host}" if pid is not None else "not yet connected"
        return (f"tensor parallel: rank {rank} ({where}) closed its connection (the process exited)"
                + (f": {reason}" if reason else "") + "; restart the engine")

    def _note_dead(self, rank: int) -> None:
        with self._dead_lock:               # the watcher and the engine thread may both see the death
            if self.failure is None:
                self.failure = self._death(rank)

    def _worker_error(self, rank: int) -> str | None:
        c = self.conns[rank - 1]
        if c is None:
            return None
        try:
            while c.poll(0):
                msg = recv(c)
                if msg[0] == "error":
                    return msg[1].strip().splitlines()[-1]
        except (EOFError, OSError):
            pass
        return None

    def _dead_rank(self) -> int | None:
        for s in self.spawned:
            if s.proc.poll() is not None:
                return s.rank
        return None

    def check(self) -> None:
        """Raise RankFailure when a worker is gone."""
        if self.failure is None:
            rank = self._dead_rank()
            if rank is not None:
                self._note_dead(rank)
        if self.failure is not None:
            raise RankFailure(self.failure)

    def explain(self, err: BaseException) -> BaseException:
        """A collective's error -> RankFailure naming the dead rank (it may take a moment to be reaped)."""
        if isinstance(err, RankFailure):
            return err
        end = time.monotonic() + 2.0
        while self.failure is None and time.monotonic() < end:
            rank = self._dead_rank()
            if rank is not None:
                self._note_dead(rank)
                break
            time.sleep(0.05)
        if self.failure is None:
            self.failure = f"tensor parallel: a collective failed ({err}); restart the engine"
        return RankFailure(self.failure)

    def _expect(self, kind: str) -> list[tuple]:
        """Every worker's `kind` message (its fields), failing at once when one dies instead."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        out = []
        for rank, c in enumerate(self.conns, 1):
            while not c.poll(0.2):
                self.check()
                if time.monotonic() > deadline:
                    raise RankFailure(f"tensor parallel: rank {rank} sent no {kind!r} in {JOIN_TIMEOUT_S} s")
            try:
                msg = recv(c)
            except (EOFError, OSError) as e:
                self._note_dead(rank)
                raise self.explain(e) from e
            if msg[0] == "error":
                self.failure = f"tensor parallel: rank {rank} failed: {msg[1].strip()}"
                raise RankFailure(self.failure)
            if msg[0] != kind:
                raise RankFailure(f"tensor parallel: rank {rank} sent {msg[0]!r}, expected {kind!r}")
            out.append(msg[1:])
        return out

    # ---- messages ------------------------------------------------------------------------------
    def send(self, *msg) -> None:
        self.check()
        try:
            for c in self.conns:
                send(c, *msg)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise self.explain(e) from e

    def wait_loaded(self) -> None:
        self.worker_bytes = [m[0] for m in self._expect("loaded")]

    def min_blocks(self, own: int) -> int:
        """After send("profile"): the KV blocks every rank's memory holds, the smallest of each rank's budget and
        rank 0's own."""
        return min([own] + [m[0] for m in self._expect("blocks")])

    def capture(self) -> None:
        """Every rank captures the same graphs, collectives included (call beside rank 0's own capture)."""
        self.send("capture")

    def wait_captured(self) -> None:
        self._expect("captured")

    def launch(self, input_ids: torch.Tensor, md, timed: bool, graphed: bool) -> None:
        """Send one forward's plan: the header, then a broadcast of [ids | positions | slots | logits idx |
        cu_seqlens_q | seq_lens | block tables] (int64, rank 0's device tensors)."""
        B, W = md.block_tables.shape
        header = (input_ids.shape[0], B, W, md.logits_indices.shape[0], list(md.q_lens), list(md.seq_lens_cpu),
                  md.max_seqlen_q, md.max_seqlen_k)
        self.send("exec", header, timed, graphed)
        self.pending_timings += timed
        buf = torch.cat([input_ids, md.positions, md.slot_mapping, md.logits_indices, md.cu_seqlens_q.long(),
                         md.seq_lens.long(), md.block_tables.reshape(-1).long()])
        assert buf.numel() == sum(packed_sizes(*header[:4]))
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
                try:
                    msg = recv(c)
                except (EOFError, OSError) as e:
                    self._note_dead(rank)
                    raise self.explain(e) from e
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
            if c is None:
                continue
            try:
                send(c, "close")
            except Exception:
                pass
        # leave the group while the workers leave it too (an NCCL teardown may wait for its peers)
        abort_group(force=self.failure is not None)
        for s in self.spawned:
            try:
                s.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor parallel: rank %s did not stop; terminating", s.rank)
                s.proc.terminate()
                try:
                    s.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait()
        for c in self.conns:
            if c is not None:
                c.close()


def _closed(sock: socket.socket) -> bool:
    """A readable socket whose peer is gone (EOF or reset), without consuming a byte of a message."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
