"""Two-process harness for the one-shot all-reduce against NCCL on this machine's GPUs, used by the GPU test
(`check`) and by `bench_tp.py --sections allreduce` (`bench`): each rank a process on its own GPU, NCCL and the
custom all-reduce built as the engine builds them (engine/distributed/parallel_state.init_group)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import free_port  # noqa: E402
from engine.distributed.parallel_state import abort_group, init_group  # noqa: E402

SIZES = (1, 4095, 4096 * 8, 65_537, 4096 * 128, 1_000_003, 4096 * 1024)     # elements


def _group(rank: int, world: int, port: int):
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=True)
    tp = init_group(rank, world, store, torch.device("cuda", rank))
    assert tp.custom is not None, "custom all-reduce not built"
    return tp


def _check(rank: int, world: int, port: int, out: dict) -> None:
    tp = _group(rank, world, port)
    try:
        g = torch.Generator(device=f"cuda:{rank}").manual_seed(1234 + rank)
        for dtype in (torch.bfloat16, torch.float32):
            for n in SIZES:
                if n * dtype.itemsize > tp.custom.slot_bytes:
                    continue
                for _ in range(3):                                  # both slots, and back to the first
                    x = torch.randn(n, device=f"cuda:{rank}", dtype=dtype, generator=g)
                    ref = x.clone()
                    dist.all_reduce(ref)
                    tp.custom(x)
                    assert torch.equal(x, ref), f"{dtype} n={n}: max diff {(x.float() - ref.float()).abs().max()}"
        # captured in a CUDA graph (as the engine's decode steps), replayed on fresh inputs
        x = torch.zeros(4096 * 37, device=f"cuda:{rank}", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            tp.custom(x.clone())                                     # warm-up: compiled outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tp.custom(x)
            tp.custom(x)
        for _ in range(5):
            x.copy_(torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=g))
            ref = x.clone()
            dist.all_reduce(ref)
            dist.all_reduce(ref)
            graph.replay()
            assert torch.equal(x, ref), "graph replay differs from NCCL"
        torch.cuda.synchronize()
        out[rank] = "ok"
    finally:
        abort_group()


def _bench(rank: int, world: int, port: int, out: dict) -> None:
    tp = _group(rank, world, port)
    rows = []
    try:
        for n in (4096, 4096 * 16, 4096 * 64, 4096 * 128, 4096 * 256, 4096 * 512, 4096 * 1024):
            x = torch.randn(n, device=f"cuda:{rank}", dtype=torch.bfloat16)
            row = dict(elements=n, kib=n * 2 // 1024)
            for name, fn in (("nccl", dist.all_reduce), ("custom", tp.custom)):
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        fn(x)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        fn(x)
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
                dist.barrier()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                row[f"{name}_us"] = a.elapsed_time(b) * 1e3 / 200
                del graph
            rows.append(row)
        out[rank] = rows
    finally:
        abort_group()


def _entry(rank: int, world: int, port: int, what: str, out) -> None:
    torch.cuda.set_device(rank)
    res: dict = {}
    (_check if what == "check" else _bench)(rank, world, port, res)
    out.put((rank, res[rank]))


def run(what: str, world: int = 2):
    """Every rank's result ("ok" from check, rows from bench); raises if a rank failed."""
    os.environ.update(NCCL_NVLS_ENABLE="0")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_entry, args=(world, free_port(), what, q), nprocs=world, start_method="spawn")
    res = dict(q.get() for _ in range(world))
    return [res[r] for r in range(world)]


if __name__ == "__main__":
    print(run(sys.argv[1] if len(sys.argv) > 1 else "check"))
