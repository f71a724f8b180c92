"""Temperature sampling in one pass over the logits: argmax(logits / T + Gumbel noise) per row.

The Gumbel-max trick draws exactly from softmax(logits / T) (the same law as the exponential race
argmax(p / Exp(1)) of the torch reference), reading each logit once instead of the five passes of
divide, softmax, draw, divide and argmax. Rows with T <= 0 take the plain argmax (greedy). Noise comes
from Philox (tl.rand) keyed by (seed, row, token), so a launch depends only on its seed argument.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.counters import zeroed_counters


@triton.jit(do_not_specialize=["seed"])
def _gumbel_argmax_kernel(logits_ptr, temp_ptr, val_ptr, idx_ptr, seed, V, stride, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr, tok_ptr=None, cnt_ptr=None, ONE_LAUNCH: tl.constexpr = False,
                          NP: tl.constexpr = 1):
    """Program (row, chunk): the best of logits / T + Gumbel over one CHUNK of the vocabulary (greedy rows: of
    the logits, no noise drawn). ONE_LAUNCH: the row's last program to finish reduces its NP-padded chunk winners
    into the token (int64 at tok_ptr[row]); else they are left in val/idx for torch."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    if t <= 0.0:                                                  # greedy: a plain argmax
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            upd = y > best_v                                      # strict: first index wins a tie
            best_v = tl.where(upd, y, best_v)
            best_i = tl.where(upd, offs, best_i)
    else:
        inv_t = 1.0 / t
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            u = tl.maximum(tl.rand(seed, row * V + offs), 1e-12)
            y = x * inv_t - tl.log(-tl.log(u))                    # logits / T + Gumbel(0, 1)
            upd = y > best_v
            best_v = tl.where(upd, y, best_v)
            best_i = tl.where(upd, offs, best_i)
    top = tl.max(best_v, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(val_ptr + out, top)
    tl.store(idx_ptr + out, tl.min(tl.where(best_v == top, best_i, V), 0))
    if ONE_LAUNCH:
        # every thread's winner is stored before one release-acquire add on the row's counter; the last program
        # reads the row's winners from L2 (.cg): chunks are in index order, so the lowest index among the
        # maxima is the first chunk's, as torch's argmax takes it
        tl.debug_barrier()
        n = tl.num_programs(1)
        cnt = cnt_ptr + row
        if tl.atomic_add(cnt, 1, sem="acq_rel") == n - 1:
            c = tl.arange(0, NP)
            v = tl.load(val_ptr + row * n + c, mask=c < n, other=float("-inf"), cache_modifier=".cg")
            i = tl.load(idx_ptr + row * n + c, mask=c < n, other=V, cache_modifier=".cg")
            best = tl.min(tl.where(v == tl.max(v, 0), i, V), 0)
            tl.store(tok_ptr + row, best.to(tl.int64))
            tl.atomic_xchg(cnt, 0)                                # zero again for the next launch (graph replays)


def _chunk_for(B: int, V: int, device: torch.device) -> int:
    """Vocabulary entries per program: a grid of about two programs per SM at small B (batch 1 at a 128k vocab:
    512 entries x 251 programs instead of 8192 x 16), at most 8192."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per_row = max(1, 2 * sms // max(B, 1))
    return min(8192, max(512, triton.next_power_of_2(triton.cdiv(V, per_row))))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int, chunk: int | None = None,
                  one_launch: bool = True) -> torch.Tensor:
    """logits [B, V] (last dim contiguous), temperature [B] float32 (<= 0: greedy) -> token ids [B] int64.
    Grid (B, V / chunk). one_launch (EngineConfig.sampler_one_launch): chunk None sizes the grid to fill the
    chip and the chunk winners are reduced in the kernel; else chunk None is 8192 and torch reduces them.
    No host sync: the launch depends only on shapes and the seed."""
    B, V = logits.shape
    assert logits.stride(-1) == 1 and temperature.shape == (B,)
    if B == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    chunk, block, n = _grid(B, V, logits.device, chunk, one_launch)
    vals = torch.empty((B, n), dtype=torch.float32, device=logits.device)
    idx = torch.empty((B, n), dtype=torch.int32, device=logits.device)
    extra = {}
    if one_launch:
        tok = torch.empty(B, dtype=torch.int64, device=logits.device)
        extra = dict(tok_ptr=tok, cnt_ptr=zeroed_counters("gumbel_rows", logits.device, B), ONE_LAUNCH=True,
                     NP=triton.next_power_of_2(n))
    _gumbel_argmax_kernel[(B, n)](logits, temperature, vals, idx, seed & 0x7FFFFFFF, V, logits.stride(0),
                                  CHUNK=chunk, BLOCK=block, num_warps=4, **extra)
    if one_launch:
        return tok
    best = vals.argmax(1, keepdim=True)                           # first chunk wins a tie
    return idx.gather(1, best).squeeze(1).long()


def _grid(B: int, V: int, device: torch.device, chunk: int | None, one_launch: bool) -> tuple[int, int, int]:
    """-> (CHUNK, BLOCK, programs per row) of a launch over B rows."""
    chunk = min(chunk or (_chunk_for(B, V, device) if one_launch else 8192), triton.next_power_of_2(V))
    block = min(1024, triton.next_power_of_2(chunk))
    chunk = max(block, chunk // block * block)
    return chunk, block, triton.cdiv(V, chunk)


def warmup_gumbel(V: int, max_batch: int, device: torch.device, one_launch: bool = True) -> int:
    """Launch once per kernel variant that batches of 1..max_batch rows reach (CHUNK and NP follow the batch
    size), so that no serving step compiles one: a compile takes ~0.3 s, during which every stream waits.
    Returns the number of variants."""
    variants: dict[tuple[int, int, int], int] = {}
    for b in range(1, max_batch + 1):
        variants.setdefault(_grid(b, V, device, None, one_launch), b)
    for b in variants.values():
        gumbel_sample(torch.zeros(b, V, device=device), torch.zeros(b, device=device), 0, one_launch=one_launch)
    return len(variants)


def gumbel_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
    """The torch law it must match: exponential race over softmax(logits / T); argmax for T <= 0."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = (logits.float() / t[:, None]).softmax(-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(greedy, logits.argmax(-1), (probs / q).argmax(-1))
