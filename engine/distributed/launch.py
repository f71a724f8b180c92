"""How the ranks of a tensor-parallel engine find each other.

Two launches, one worker program (`python -m engine.distributed.worker`):

- spawned (the default): rank 0 is the engine's process; it starts ranks 1..N-1 itself as fresh interpreters
  running the worker module, so the user's script is never imported again (no `if __name__ == "__main__"`
  guard needed) and the worker's stderr is kept for the error that reports its death;
- torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): every rank is
  started by the launcher; rank 0 runs the engine, the other ranks serve as workers (`serve_if_worker`).

Either way the ranks meet at a TCPStore (torchrun's own, or one rank 0 hosts), where rank 0 publishes the
address of its control listener; each worker connects to it, says who it is, and receives its arguments.
"""
from __future__ import annotations

import datetime
import os
import secrets
import socket
from dataclasses import dataclass

import torch

from engine.ipc import set_nodelay

JOIN_TIMEOUT_S = 600        # a worker builds its shard within this (70B-shape dummy weights take a while)
CONTROL_KEY, AUTH_KEY = "kvscope/control", "kvscope/authkey"


@dataclass(frozen=True)
class EnvLaunch:
    """The torchrun variables of this process."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool           # torchrun hosts the store (TORCHELASTIC_USE_AGENT_STORE)


def env_launch(environ=None) -> EnvLaunch | None:
    """The launcher's variables when this process is one rank of several (WORLD_SIZE > 1), else None."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in env:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"launch: RANK and WORLD_SIZE are set but {missing} are not (set them as torchrun does)")
    return EnvLaunch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                     env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                     env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")


def open_store(launch: EnvLaunch | None, world_size: int) -> "torch.distributed.TCPStore":
    """The rendezvous store: rank 0 hosts one on a free local port when it spawns the workers; under torchrun
    it is the launcher's (rank 0 hosts it when no agent does, as torch's env:// rendezvous)."""
    timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    if launch is None:
        return torch.distributed.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout,
                                          wait_for_workers=False)
    master = launch.rank == 0 and not launch.agent_store
    return torch.distributed.TCPStore(launch.master_addr, launch.master_port, launch.world_size, master,
                                      timeout=timeout, wait_for_workers=False)


def control_listener(store, launch: EnvLaunch | None):
    """Rank 0's listener for the workers' control connections, published in the store."""
    from multiprocessing.connection import Listener
    key = secrets.token_bytes(32)
    host = "127.0.0.1" if launch is None else "0.0.0.0"
    listener = Listener((host, 0), authkey=key)
    port = listener.address[1]
    addr = "127.0.0.1" if launch is None else _reachable_addr(launch.master_addr)
    store.set(CONTROL_KEY, f"{addr}:{port}")
    store.set(AUTH_KEY, key.hex())
    return listener


def _reachable_addr(master_addr: str) -> str:
    """The address other nodes reach rank 0 at: MASTER_ADDR names rank 0's node under torchrun."""
    try:
        socket.getaddrinfo(master_addr, None)
        return master_addr
    except OSError:
        return socket.gethostname()


def connect_control(store):
    """A worker's connection to rank 0's control listener."""
    from multiprocessing.connection import Client
    host, port = store.get(CONTROL_KEY).decode().rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(store.get(AUTH_KEY).decode()))
    set_nodelay(conn)
    return conn
