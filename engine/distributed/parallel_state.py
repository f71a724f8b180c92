"""The tensor-parallel group of one engine: this process's rank, the group size, and the collectives the model
calls (torch.distributed: NCCL on cuda, gloo on cpu). Size 1 is the plain single-device engine."""
from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass

import torch

from engine.distributed.custom_all_reduce import CustomAllReduce

# a collective waits this long for a peer before it fails (a dead peer on gloo fails at once: its socket closes)
COLLECTIVE_TIMEOUT_S = 120
ABORT_WAIT_S = 10.0           # how long leaving a group after a peer died may hold the caller


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    backend: str | None = None          # "nccl" | "gloo" | None (size 1)
    custom: CustomAllReduce | None = None   # the one-shot all-reduce for small tensors (one machine, CUDA)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.custom is not None and self.custom.fits(x):
            return self.custom(x)
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        return x

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[L, n] on each rank -> [L, size * n], rank r's columns at [r * n, (r + 1) * n)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.backend == "nccl":
            out = x.new_empty((self.size,) + tuple(x.shape))                 # [size, L, n]
            torch.distributed.all_gather_into_tensor(out, x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            torch.distributed.all_gather(parts, x)
            out = torch.stack(parts)                                         # [size, L, n]
        return out.permute(1, 0, 2).reshape(x.shape[0], -1)                 # [L, size * n]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x to every rank, in place."""
        if self.size > 1:
            torch.distributed.broadcast(x, 0)
        return x


SINGLE = TensorParallel()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a spawned engine runs on the r-th device after the engine's own (cuda:N -> cuda:N+r); every
    rank on one CPU. Always with an index on cuda (set_device and NCCL need one)."""
    if device.type != "cuda":
        return device
    base = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", base + rank)


_custom: CustomAllReduce | None = None      # this process's engine's (one tensor-parallel engine per process)
_retired: list[CustomAllReduce] = []        # aborted when a peer died: mapped until nothing can replay them


def init_group(rank: int, size: int, store: "torch.distributed.Store", device: torch.device,
               custom_all_reduce: bool = True) -> TensorParallel:
    """Join the engine's process group (its keys under their own prefix of the rendezvous store) and, on CUDA
    with every rank on this machine, map the one-shot all-reduce's buffers (custom_all_reduce). NVLink
    multicast (NVLS) stays off: it is not available on the lent multi-GPU machines, and nothing here calls
    cuMulticastCreate."""
    global _custom
    for c in _retired:                  # an earlier engine's, whose waits its abort word ended
        torch.cuda.synchronize(c.abort_flag.device)
        c.close()
    _retired.clear()
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    # a dead worker is handled here (executor.py aborts the group and fails the requests); NCCL's own
    # error handling would take the engine process down with it
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    kw = {}
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"tensor parallel: rank {rank} needs a CUDA device with an index (got {device})")
        torch.cuda.set_device(device)
        kw["device_id"] = device            # binds the communicator to this rank's GPU (created eagerly)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("kvscope/pg", store),
                                         rank=rank, world_size=size,
                                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kw)
    _custom = CustomAllReduce.create(rank, size, device, torch.distributed.PrefixStore("kvscope/custom_ar", store)) \
        if device.type == "cuda" and custom_all_reduce and size > 1 else None
    return TensorParallel(rank, size, backend, _custom)


def abort_group(force: bool = False) -> None:
    """Leave the process group; force: even when a peer is gone (an NCCL collective waiting on it returns)."""
    global _custom
    dist = torch.distributed
    custom, _custom = _custom, None
    if custom is not None:
        try:
            custom.abort()              # a call waiting on a peer that is gone (or never comes) ends
            if force:                   # calls still queued or captured read its buffers: unmapped later
                _retired.append(custom)
            else:
                torch.cuda.synchronize(custom.abort_flag.device)
                custom.close()
        except Exception:               # a CUDA error after a peer's fault: NCCL must still be left below
            pass
    if not dist.is_initialized():
        return
    c10d = dist.distributed_c10d
    try:
        if force and dist.get_backend() == "nccl":
            def abort():
                if hasattr(c10d, "_abort_process_group"):
                    c10d._abort_process_group()
                else:
                    c10d._get_default_group()._get_backend(torch.device("cuda")).abort()
                    dist.destroy_process_group()
            # NCCL's abort still waits for the CUDA graphs that captured this communicator's collectives to be
            # destroyed; after a peer died they may still be alive here, so it must not hold the caller
            t = threading.Thread(target=abort, name="kvscope-nccl-abort", daemon=True)
            t.start()
            t.join(ABORT_WAIT_S)
        else:
            dist.destroy_process_group()
    except Exception:       # already torn down: nothing more to release
        pass
