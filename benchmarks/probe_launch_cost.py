"""Host cost of the launches in a grammar iteration, with the GPU idle and with it busy (a long kernel ahead
in the stream, as when a forward is in flight): does a launch or a small host-to-device copy wait for the
stream? Prints microseconds per call.

    python benchmarks/probe_launch_cost.py [--batch 32]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import print_table, write_json  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.worker.host_copy import HostCopy  # noqa: E402
from engine.sample.sampler import SampleRow, sample_on_device  # noqa: E402
from engine.kernels.sampling import gumbel_sample  # noqa: E402
from engine.kernels.token_bitmask import apply_token_bitmask  # noqa: E402


def per_call_us(fn, n: int = 200) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    B, V, dev = args.batch, 49152, torch.device("cuda")
    logits = torch.randn(B, V, device=dev)
    temp = torch.ones(B, device=dev)
    words = (V + 31) // 32
    packed_host = torch.full((B * words + B,), -1, dtype=torch.int32, pin_memory=True)
    packed_host[B * words:] = torch.arange(B, dtype=torch.int32)
    ids = torch.zeros(B, dtype=torch.int64, device=dev)
    static = torch.zeros(B, dtype=torch.int64, device=dev)
    rows32 = [SampleRow(SamplingParams(temperature=1.0, max_tokens=16), [], 8, 0) for _ in range(B)]
    calls = {
        "sample_on_device (engine sampler)": lambda: sample_on_device(logits, rows32, None, True),
        "small list -> device (pageable)": lambda: torch.tensor([1.0] * B).to(dev, non_blocking=True),
        "small list -> device (pinned)": lambda: torch.tensor([1.0] * B, pin_memory=True).to(dev, non_blocking=True),
        "mask rows -> device (pinned, 196 KB)": lambda: packed_host.to(dev, non_blocking=True),
        "apply_token_bitmask (Triton)": lambda: apply_token_bitmask(
            logits, packed_host.to(dev, non_blocking=True)[:B * words].view(B, words),
            packed_host.to(dev, non_blocking=True)[B * words:]),
        "gumbel_sample (Triton + 3 torch ops)": lambda: gumbel_sample(logits, temp, 1234),
        "HostCopy(tokens)": lambda: HostCopy(ids),
        "torch copy_ into a static buffer": lambda: static.copy_(ids),
        "torch.empty on device": lambda: torch.empty(B, V, device=dev),
    }
    for fn in calls.values():                       # compile, warm the allocators
        fn()
    torch.cuda.synchronize()
    rows = []
    for busy in (False, True):
        for name, fn in calls.items():
            if busy:
                torch.cuda._sleep(int(2e8))         # ~100 ms of GPU time ahead of the calls
            rows.append(dict(gpu="busy" if busy else "idle", call=name, us=per_call_us(fn)))
            torch.cuda.synchronize()
    path = write_json("probe_launch_cost", dict(batch=B, rows=rows))
    print_table(rows, ["gpu", "call", "us"])
    print(f"json: {path}")


if __name__ == "__main__":
    main()
