"""A host-written counter the GPU stream waits on (the driver's cuStreamWaitValue32), so GPU work that needs
data the host has not produced yet can be enqueued ahead of it.

A grammar block uses it (EngineConfig.structured_gpu_wait): each iteration's mask copy, mask, sampler and
next forward are launched before the host has the mask; the stream stops at `wait(v)` until the host's grammar
thread has filled that mask into pinned memory and called `open(v)`. Launch costs then leave the chain that
the GPU waits on (previous tokens -> grammars -> mask), which shrinks to the grammar work itself.

The counter is one pinned int32 word; pinned host memory is mapped into the device's unified address space,
so its host pointer is also the address the stream polls. Values only grow (compared wrap-safe by the driver's
GEQ), so a stale wait from an earlier block can never block a later one. On the CPU, whose "stream" is the
engine thread itself, HostGate blocks that thread instead (the same protocol, for tests).
"""
from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_CU_STREAM_WAIT_VALUE_GEQ = 0x0


def _driver_wait_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class StreamGate:
    def __init__(self, device: torch.device):
        self.device = device
        self._wait = _driver_wait_fn()
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._flag = self.flag.numpy()              # host writes without a torch dispatch
        self.value = 0                              # the last value opened (or to be opened) by the host

    def wait(self, value: int) -> None:
        """Enqueue on the current stream: nothing behind this runs until the host has opened `value`."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        err = self._wait(stream, self.flag.data_ptr(), value & 0xFFFFFFFF, _CU_STREAM_WAIT_VALUE_GEQ)
        if err:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {err}")

    def open(self, value: int) -> None:
        """Let the stream past every wait up to `value` (after the data it guards is written)."""
        v = value & 0xFFFFFFFF
        self._flag[0] = v - (1 << 32) if v >= (1 << 31) else v      # (int32 storage, compared as uint32)

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether the driver takes a wait on pinned host memory: one already satisfied, synced."""
        if device.type != "cuda":
            return False
        try:
            gate = StreamGate(device)
            gate.open(1)
            gate.wait(1)
            torch.cuda.synchronize(device)
            return True
        except (OSError, AttributeError, RuntimeError):
            return False


class HostGate:
    """StreamGate's protocol where kernels run on the calling thread (CPU): `wait` blocks it."""

    def __init__(self):
        self.value = 0
        self._opened = 0
        self._cv = threading.Condition()

    def wait(self, value: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._opened >= value)

    def open(self, value: int) -> None:
        with self._cv:
            self._opened = max(self._opened, value)
            self._cv.notify_all()


def make_gate(device: torch.device) -> tuple[StreamGate | HostGate, ThreadPoolExecutor]:
    """EngineConfig.structured_gpu_wait's gate (StreamGate on CUDA, HostGate on the CPU) and the one thread that
    fills the gated masks."""
    if device.type != "cuda":
        gate = HostGate()
    elif StreamGate.available(device):
        gate = StreamGate(device)
    else:
        raise ValueError("EngineConfig.structured_gpu_wait: this CUDA driver takes no stream wait on host memory "
                         "(cuStreamWaitValue32)")
    return gate, ThreadPoolExecutor(1, thread_name_prefix="kvscope-grammar")
