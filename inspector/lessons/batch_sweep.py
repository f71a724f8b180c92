"""Batch-size sweep: decode is memory-bound, so a step of B requests costs little more than a step of one (the
weights are read once per step either way) until compute or the KV reads take over; on a GPU the HBM roofline
(weights + KV bytes per step at the measured copy bandwidth) is the floor."""
from __future__ import annotations

import time

import numpy as np
import torch

from inspector.lessons.common import Setup, close, greedy, kv_pool, random_prompts, result, run

TITLE = "Batch-size sweep"
WHAT = ("Decode tok/s grows almost linearly with the batch while ms/step barely moves, because each step reads "
        "the weights once for the whole batch, until the step stops being bound by memory reads.")


def hbm_bandwidth(device: torch.device, mib: int = 512, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the roofline's slope."""
    x = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        y.copy_(x)
    torch.cuda.synchronize(device)
    return 2 * x.numel() * iters / (time.perf_counter() - t0)


def run_lesson(setup: Setup, batches: list[int] | None = None, prompt_len: int = 16, output_len: int | None = None) -> dict:
    large = setup.large
    batches = batches or ([1, 2, 4, 8, 16, 32, 64, 128, 256, 512] if large else [1, 2, 4, 8, 16, 32])
    output_len = output_len or (128 if large else 24)
    max_len = prompt_len + output_len + 1
    eng = setup.engine(max_num_seqs=max(batches), max_model_len=max_len, enable_prefix_caching=False,
                       max_num_batched_tokens=max(256, prompt_len * max(batches)),
                       **kv_pool(max(batches), max_len))
    bw = hbm_bandwidth(eng.device) if eng.device.type == "cuda" else None
    rows = []
    for b in batches:
        r = run(eng, random_prompts(b, prompt_len, eng.arch_config.vocab_size, setup.seed + b), greedy(output_len))
        tpot = float(np.mean([o.tpot for o in r.outputs.values()]))
        row = dict(batch=b, ms_per_step=tpot * 1e3, decode_tok_s=b / tpot, output_tok_s=r.output_tokens / r.wall)
        if bw:
            ctx = prompt_len + output_len / 2                       # mean context over the decode
            floor = (eng.weight_bytes + b * ctx * eng.slot_bytes) / bw
            row.update(roofline_ms_per_step=floor * 1e3, roofline_tok_s=b / floor)
        rows.append(row)
    model = eng
    close(eng)
    summary = dict(tok_s_ratio=rows[-1]["decode_tok_s"] / rows[0]["decode_tok_s"], largest_batch=batches[-1],
                   step_time_ratio=rows[-1]["ms_per_step"] / rows[0]["ms_per_step"],
                   hbm_bytes_per_s=bw, weight_bytes=model.weight_bytes)
    return result("batch_sweep", TITLE, WHAT, model, {"sweep": rows}, summary, batches=batches,
                  prompt_len=prompt_len, output_len=output_len)
