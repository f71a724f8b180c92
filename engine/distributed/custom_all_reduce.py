"""The one-shot all-reduce's buffers (engine/kernels/all_reduce.py), mapped into every rank of one machine.

Each rank allocates its buffer with the CUDA driver (cuMemAlloc: plain device memory, which CUDA IPC can share,
unlike the caching allocator's expandable segments), zeroes it, and publishes its IPC handle in the engine's
rendezvous store; every rank opens its peers' handles, so each process holds the addresses of all the buffers.
It is used only when every rank is on this machine, on distinct devices that reach each other directly (NVLink
or PCIe peer access), and for tensors of at most `slot_bytes`; everything else goes through NCCL. The decision
is the same on every rank: each one reads the same published facts.
"""
from __future__ import annotations

import ctypes
import logging
import socket

import torch

from engine.kernels.all_reduce import NPROG, buffer_bytes, one_shot_all_reduce

log = logging.getLogger("kvscope.distributed")

SLOT_BYTES = 8 << 20            # largest message: a decode step's activations up to 1,024 tokens of 4,096 bf16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Driver:
    """The few CUDA driver calls this needs (libcuda, present wherever a GPU is), on the current context."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.open_handle = getattr(self.lib, "cuIpcOpenMemHandle_v2", None) or self.lib.cuIpcOpenMemHandle

    def check(self, result: int, what: str) -> None:
        if result != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(msg))
            raise RuntimeError(f"custom all-reduce: {what} failed: {msg.value.decode() if msg.value else result}")

    def alloc_zeroed(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        self.check(self.lib.cuMemsetD8_v2(ptr, ctypes.c_ubyte(0), ctypes.c_size_t(nbytes)), "cuMemsetD8")
        self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")
        return ptr.value

    def handle(self, ptr: int) -> bytes:
        h = _CUipcMemHandle()
        self.check(self.lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), 64)

    def open(self, handle: bytes) -> int:
        ptr = ctypes.c_uint64()
        h = _CUipcMemHandle.from_buffer_copy(handle)
        self.check(self.open_handle(ctypes.byref(ptr), h, ctypes.c_uint(1)), "cuIpcOpenMemHandle")  # lazy peer access
        return ptr.value

    def close(self, ptr: int) -> None:
        self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr))

    def free(self, ptr: int) -> None:
        self.lib.cuMemFree_v2(ctypes.c_uint64(ptr))


class CustomAllReduce:
    """The one-shot all-reduce of one tensor-parallel group on one machine. Built by every rank at once (it waits
    in the store for the others); `create` returns None on every rank when the group cannot use it."""

    def __init__(self, rank: int, world: int, device: torch.device, store, slot_bytes: int = SLOT_BYTES):
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.driver = _Driver()
        torch.zeros(1, device=device)                       # the device's primary context, current on this thread
        self.own = self.driver.alloc_zeroed(buffer_bytes(world, slot_bytes))
        self.peers: list[int] = []
        try:
            store.set(f"custom_ar/handle/{rank}", self.driver.handle(self.own))
            ptrs = []
            for r in range(world):
                if r == rank:
                    ptrs.append(self.own)
                else:
                    ptrs.append(self.driver.open(store.get(f"custom_ar/handle/{r}")))
                    self.peers.append(ptrs[-1])
        except BaseException:
            self.close()
            raise
        self.bufs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.parity = torch.zeros(NPROG, dtype=torch.int32, device=device)
        self.abort_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._one = torch.ones(1, dtype=torch.int32, pin_memory=True)

    @staticmethod
    def create(rank: int, world: int, device: torch.device, store) -> "CustomAllReduce | None":
        """Every rank publishes its host and device; all read all and decide alike."""
        store.set(f"custom_ar/where/{rank}", f"{socket.gethostname()}|{device.index}")
        where = [store.get(f"custom_ar/where/{r}").decode().split("|") for r in range(world)]
        hosts, devices = {h for h, _ in where}, [int(d) for _, d in where]
        usable = (len(hosts) == 1 and len(set(devices)) == world
                  and all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b))
        if not usable:
            log.info("custom all-reduce off: ranks on %d host(s), devices %s without peer access to each other",
                     len(hosts), devices)
            return None
        return CustomAllReduce(rank, world, device, store)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= self.slot_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return one_shot_all_reduce(x, self.bufs, self.parity, self.abort_flag, self.rank, self.world, self.slot_bytes)

    def abort(self) -> None:
        """End every wait of a running or later call (a peer is gone): a copy engine's write, on a stream of its
        own, reaches the flag while a call spins on the engine's stream."""
        with torch.cuda.stream(torch.cuda.Stream(self.abort_flag.device)):
            self.abort_flag.copy_(self._one, non_blocking=True)
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        for p in self.peers:
            self.driver.close(p)
        self.peers = []
        if self.own:
            self.driver.free(self.own)
            self.own = 0
