"""The tensor-parallel group of one engine: this process's rank, the group size, and the collectives the model
calls (torch.distributed: NCCL on cuda, gloo on cpu). Size 1 is the plain single-device engine.

Small all-reduces on CUDA (a decode step's activations: a few KB per layer at batch 1) go through a one-shot
all-reduce over symmetric memory instead of NCCL, as vLLM's custom all-reduce does: each rank copies its
input into a buffer mapped by every peer, and one kernel reads all peers' buffers and sums them (torch's
`symm_mem.one_shot_all_reduce_copy_out`, point-to-point loads, no NVLink multicast). NCCL's ring keeps the
large ones (prefill), where reading every peer's whole buffer costs more than it saves."""
from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

# a collective waits this long for a peer before it fails (a dead peer on gloo fails at once: its socket closes)
COLLECTIVE_TIMEOUT_S = 120
ABORT_WAIT_S = 10.0           # how long leaving a group after a peer died may hold the caller
# largest all-reduce (bytes) taken by the one-shot kernel; bigger ones go to NCCL (benchmarks/bench_tp.py allreduce)
ONE_SHOT_MAX_BYTES = 512 << 10


class OneShotAllReduce:
    """Sum over the ranks of tensors up to `max_bytes`, through a symmetric-memory buffer every rank maps."""

    def __init__(self, group_name: str, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name, self.max_bytes = group_name, max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group_name)             # collective: every rank maps every buffer

    def fits(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        return x.is_contiguous() and n <= self.max_bytes and n % 16 == 0 and x.dtype in (
            torch.bfloat16, torch.float16, torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """In place, as torch.distributed.all_reduce."""
        flat = x.view(-1)
        symm = self.buffer.view(x.dtype)[:flat.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, flat)
        return x


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    backend: str | None = None          # "nccl" | "gloo" | None (size 1)
    one_shot: OneShotAllReduce | None = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
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


def init_group(rank: int, size: int, store: "torch.distributed.Store", device: torch.device,
               custom_all_reduce: bool = True) -> TensorParallel:
    """Join the engine's process group (its keys under their own prefix of the rendezvous store), and on CUDA
    map the one-shot all-reduce's buffers unless `custom_all_reduce` is off (then NCCL does every all-reduce).
    NVLink multicast (NVLS) stays off: it can take a shared host's GPUs out of service, and nothing here calls
    cuMulticastCreate."""
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
    tp = TensorParallel(rank, size, backend)
    one_node = os.environ.get("LOCAL_WORLD_SIZE", str(size)) == str(size)     # torchrun sets it; spawned: one node
    # torch >= 2.9: rendezvous finds the group's own store (before, a per-name cache kept the first group's, and a
    # second engine in one process waited on a store that was gone)
    new_torch = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)
    if backend == "nccl" and custom_all_reduce and one_node and new_torch:
        tp.one_shot = _one_shot_or_none(device)
    return tp


def _one_shot_or_none(device: torch.device) -> OneShotAllReduce | None:
    """The one-shot all-reduce when every rank could map its peers' buffers, else None (NCCL for all). The ranks
    agree on the outcome (an all-reduce of the failures), so none takes a path its peers do not."""
    one_shot, err = None, ""
    try:
        one_shot = OneShotAllReduce(torch.distributed.group.WORLD.group_name, device)
    except Exception as e:                  # no peer access between the GPUs, an old driver, ...
        err = f"{type(e).__name__}: {e}"
    failed = torch.tensor([0 if one_shot is not None else 1], device=device)
    torch.distributed.all_reduce(failed)
    if failed.item():
        log.warning("tensor parallel: the one-shot all-reduce is unavailable on %d rank(s) (%s); NCCL does every "
                    "all-reduce", failed.item(), err or "on a peer")
        return None
    return one_shot


def abort_group(force: bool = False) -> None:
    """Leave the process group; force: even when a peer is gone (an NCCL collective waiting on it returns)."""
    dist = torch.distributed
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
