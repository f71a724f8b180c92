"""One-shot all-reduce over peer-mapped memory (vLLM's custom all-reduce): every rank writes its tensor into each
peer's receive buffer, raises a flag there, waits for the peers' flags, and sums the copies it received in rank
order, so every rank ends with the same bits. One kernel and no staging copy, where NCCL's ring takes several
steps of latency for the activation-sized messages of decode.

Each rank owns one buffer that its peers map (engine/distributed/custom_all_reduce.py):
  [2 slots][world][slot_bytes] receive areas: rank r's copy for the call of parity s at [s][r]
  [NPROG][world] int32 flags: flag [p][r] is raised (0 -> 1) by rank r's program p and lowered by ours
Consecutive calls alternate slots: a rank writes slot s again two calls later, when every peer has started the
call in between and so has finished reading slot s. That needs every call to run all NPROG programs, each
program keeping its own count of calls (`parity`).

`abort` (a word of the rank's own device memory, set by a copy on another stream) ends every wait: a dead peer
never raises its flag. A wait reads it once every `spin_check` spins, by one thread for the whole program (the
flags' atomics are one thread's too, shared through a barrier), so all of a program's warps leave together.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NPROG = 64                 # programs of every call (fixed: see the module docstring)
BLOCK = 2048               # elements a program moves per iteration
FLAG_BYTES = 4
_FLAG = tl.constexpr(FLAG_BYTES)


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, n, bufs_ptr, parity_ptr, abort_ptr,
                                RANK: tl.constexpr, WORLD: tl.constexpr, SLOT_BYTES: tl.constexpr,
                                FLAGS_AT: tl.constexpr, BLOCK: tl.constexpr, SPIN_CHECK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dt = x_ptr.dtype.element_ty
    par = tl.atomic_xor(parity_ptr + pid, 1).to(tl.int64)    # this program's call count, mod 2
    offs = tl.arange(0, BLOCK)
    mine = tl.load(bufs_ptr + RANK)                          # addresses (int64) of the ranks' buffers
    # push: our tensor into slot [par][RANK] of every peer
    for r in tl.static_range(WORLD):
        if r != RANK:
            dst = (tl.load(bufs_ptr + r) + (par * WORLD + RANK) * SLOT_BYTES).to(tl.pointer_type(dt))
            for start in range(pid * BLOCK, n, nprog * BLOCK):
                i = start + offs
                m = i < n
                tl.store(dst + i, tl.load(x_ptr + i, mask=m), mask=m)
    tl.debug_barrier()                                       # every thread's stores precede the flag
    stop = tl.full([], 0, tl.int32)                          # `abort` read while waiting: the wait ends
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = (tl.load(bufs_ptr + r) + FLAGS_AT + (pid * WORLD + RANK) * _FLAG).to(tl.pointer_type(tl.int32))
            spins = 0
            while (tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0) & (stop == 0):   # our last, taken
                spins += 1
                if spins % SPIN_CHECK == 0:
                    stop = tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="gpu")
    for r in tl.static_range(WORLD):
        if r != RANK:
            flag = (mine + FLAGS_AT + (pid * WORLD + r) * _FLAG).to(tl.pointer_type(tl.int32))
            spins = 0
            while (tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1) & (stop == 0):
                spins += 1
                if spins % SPIN_CHECK == 0:
                    stop = tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()                                       # the flags precede every thread's reads
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        i = start + offs
        m = i < n
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):                     # rank order: the same sum on every rank
            if r == RANK:
                acc += tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
            else:
                src = (mine + (par * WORLD + r) * SLOT_BYTES).to(tl.pointer_type(dt))
                acc += tl.load(src + i, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(x_ptr + i, acc.to(dt), mask=m)


def buffer_bytes(world: int, slot_bytes: int) -> int:
    """A rank's buffer: receive slots and flags."""
    return 2 * world * slot_bytes + NPROG * world * FLAG_BYTES


def one_shot_all_reduce(x: torch.Tensor, bufs: torch.Tensor, parity: torch.Tensor, abort: torch.Tensor,
                        rank: int, world: int, slot_bytes: int, spin_check: int = 256) -> torch.Tensor:
    """Sum x (contiguous, at most slot_bytes) over the ranks, in place. bufs: int64 [world], the address of each
    rank's buffer as this process maps it (buffer_bytes(world, slot_bytes) each, zeroed before first use);
    parity: int32 [NPROG] zeros on this rank's device; abort: int32 [1] on this rank's device, 0 until the waits
    must end."""
    assert x.is_contiguous() and x.numel() * x.element_size() <= slot_bytes
    _one_shot_all_reduce_kernel[(NPROG,)](x, x.numel(), bufs, parity, abort, RANK=rank, WORLD=world,
                                          SLOT_BYTES=slot_bytes, FLAGS_AT=2 * world * slot_bytes, BLOCK=BLOCK,
                                          SPIN_CHECK=spin_check,
                                          num_warps=8)
    return x
