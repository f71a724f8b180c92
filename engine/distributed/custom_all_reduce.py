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


def _agree(store, key: str, rank: int, world: int, ok: bool) -> bool:
    """Publish this rank's verdict and read every rank's: True on every rank, or False on every rank."""
    store.set(f"{key}/{rank}", b"1" if ok else b"0")
    return all(store.get(f"{key}/{r}") == b"1" for r in range(world))


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CustomAllReduce:
    """The one-shot all-reduce of one tensor-parallel group on one machine, built by every rank at once (each
    waits in the store for the others); `create` returns None on every rank when any rank cannot use it."""

    def __init__(self, rank: int, world: int, device: torch.device, slot_bytes: int = SLOT_BYTES):
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.driver = _Driver()
        torch.zeros(1, device=device)                       # the device's primary context, current on this thread
        self.own = self.driver.alloc_zeroed(buffer_bytes(world, slot_bytes))
        self.peers: list[int] = []
        self.bufs = self.parity = self.abort_flag = None

    def _map(self, store, device: torch.device) -> bool:
        """Publish this rank's buffer, open the peers' (every rank agrees whether all of it worked)."""
        try:
            handle = self.driver.handle(self.own)
        except RuntimeError as e:
            log.warning("custom all-reduce: rank %d cannot share its buffer: %s", self.rank, e)
            handle = b""
        store.set(f"handle/{self.rank}", handle)
        handles = [store.get(f"handle/{r}") for r in range(self.world)]
        ptrs, ok = [], all(len(h) == 64 for h in handles)
        for r, h in enumerate(handles):
            if not ok:
                break
            if r == self.rank:
                ptrs.append(self.own)
                continue
            try:
                ptrs.append(self.driver.open(h))
                self.peers.append(ptrs[-1])
            except RuntimeError as e:
                log.warning("custom all-reduce: rank %d cannot map rank %d's buffer: %s", self.rank, r, e)
                ok = False
                break
        if not _agree(store, "mapped", self.rank, self.world, ok):
            return False
        self.bufs = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.parity = torch.zeros(NPROG, dtype=torch.int32, device=device)
        self.abort_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._one = torch.ones(1, dtype=torch.int32, pin_memory=True)
        return True

    @staticmethod
    def create(rank: int, world: int, device: torch.device, store) -> "CustomAllReduce | None":
        """Every rank publishes its host and its device's UUID (CUDA_VISIBLE_DEVICES may number devices differently
        in each process), checks that it reaches every peer's device directly, and all decide alike."""
        store.set(f"where/{rank}", f"{socket.gethostname()}|{_device_uuid(device.index)}")
        where = [store.get(f"where/{r}").decode().split("|") for r in range(world)]
        local = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
        mine = [local.get(u) for _, u in where]
        ok = (len({h for h, _ in where}) == 1 and len({u for _, u in where}) == world and None not in mine
              and all(torch.cuda.can_device_access_peer(device.index, i) for i in mine if i != device.index))
        if not _agree(store, "usable", rank, world, ok):
            log.info("custom all-reduce off: the ranks are not all on one host with direct access to each other's "
                     "devices")
            return None
        car = None
        try:
            car = CustomAllReduce(rank, world, device)
        except RuntimeError as e:
            log.warning("custom all-reduce: rank %d cannot allocate its buffer: %s", rank, e)
        if not _agree(store, "allocated", rank, world, car is not None):
            if car is not None:
                car.close()
            return None
        if not car._map(store, device):
            car.close()
            return None
        return car

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= self.slot_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return one_shot_all_reduce(x, self.bufs, self.parity, self.abort_flag, self.rank, self.world, self.slot_bytes)

    def abort(self) -> None:
        """End every wait of a running or later call (a peer is gone, or the engine closes): a copy engine's
        write, on a stream of its own, reaches the word while a call spins on the engine's stream."""
        with torch.cuda.stream(torch.cuda.Stream(self.abort_flag.device)):
            self.abort_flag.copy_(self._one, non_blocking=True)
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (no call may still run or be replayed)."""
        for p in self.peers:
            self.driver.close(p)
        self.peers = []
        if self.own:
            self.driver.free(self.own)
            self.own = 0
