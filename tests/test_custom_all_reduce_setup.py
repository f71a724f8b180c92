"""The custom all-reduce's start-up, rank by rank in threads over one store: every rank must reach the same
decision (use it, or leave every all-reduce to NCCL) whatever fails on one of them, or the ranks would wait on
each other forever. The CUDA driver and the devices are stand-ins here (this runs on a CPU); the kernel itself is
tests/test_all_reduce.py's, and on two GPUs tests/test_gpu_tp.py's."""
import threading
import types

import pytest
import torch
import torch.distributed as dist

import engine.distributed.custom_all_reduce as C


class Driver:
    """Buffers and IPC handles as numbers; `fail`: {(rank, "alloc" | "open")}."""
    fail: set = set()
    freed: list = []
    unmapped: list = []

    def alloc_zeroed(self, nbytes):
        if (_rank(), "alloc") in self.fail:
            raise RuntimeError("out of memory")
        return 1000 + _rank()

    def handle(self, ptr):
        return bytes([ptr % 256]) * 64

    def open(self, handle):
        if (_rank(), "open") in self.fail:
            raise RuntimeError("invalid handle")
        return 5000 + handle[0]

    def close(self, ptr):
        self.unmapped.append(ptr)

    def free(self, ptr):
        self.freed.append(ptr)


def _rank() -> int:
    return threading.current_thread().rank


class CpuTorch:
    """torch, with tensors made on the CPU and the CUDA queries answered from `uuids` / `access`."""

    def __init__(self, uuids, access):
        self.cuda = types.SimpleNamespace(get_device_properties=lambda i: types.SimpleNamespace(uuid=uuids[i]),
                                          device_count=lambda: len(uuids), can_device_access_peer=access)

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name in ("zeros", "ones", "tensor"):
            return lambda *a, device=None, pin_memory=False, **k: fn(*a, **k)
        return fn


def start(monkeypatch, world, uuids=None, access=lambda a, b: True, fail=()):
    monkeypatch.setattr(C, "_Driver", Driver)
    monkeypatch.setattr(C, "torch", CpuTorch(uuids or [f"GPU-{i}" for i in range(world)], access))
    Driver.fail, Driver.freed, Driver.unmapped = set(fail), [], []
    store, got = dist.HashStore(), [None] * world

    def rank(r):
        threading.current_thread().rank = r
        got[r] = C.CustomAllReduce.create(r, world, torch.device("cuda", r), dist.PrefixStore("car", store))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank still waits on the others"
    return got


def test_every_rank_maps_every_buffer(monkeypatch):
    got = start(monkeypatch, 3)
    assert all(c is not None for c in got)
    assert [c.bufs.tolist()[r] for r, c in enumerate(got)] == [1000, 1001, 1002]     # its own, unmapped
    assert got[0].bufs.tolist() == [1000, 5233, 5234]                                  # the peers', mapped


@pytest.mark.parametrize("case", ["no peer access on one rank", "two ranks on one device", "one rank cannot allocate",
                                  "one rank cannot map a peer"])
def test_a_failure_on_one_rank_turns_it_off_on_every_rank(monkeypatch, case):
    kw = {"no peer access on one rank": dict(access=lambda a, b: a != 1),
          "two ranks on one device": dict(uuids=["GPU-0", "GPU-0", "GPU-2"]),
          "one rank cannot allocate": dict(fail={(1, "alloc")}),
          "one rank cannot map a peer": dict(fail={(0, "open")})}[case]
    got = start(monkeypatch, 3, **kw)
    assert got == [None, None, None]
    if "alloc" in case or "map" in case:            # whatever was allocated or mapped is released
        assert sorted(Driver.freed) == [r for r in (1000, 1001, 1002) if (r - 1000, "alloc") not in kw["fail"]]
        assert len(Driver.unmapped) == (4 if "map" in case else 0)     # ranks 1 and 2 had mapped both peers
