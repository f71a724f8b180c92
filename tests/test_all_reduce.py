"""The one-shot all-reduce kernel's protocol, two ranks emulated in one process on the Triton interpreter: rank
1's half of each call (its copy pushed into rank 0's buffer, its flags raised there) is written by hand, rank 0's
kernel runs, then rank 1's. Both must end with the same sum, the flags lowered, and consecutive calls must use
alternate slots. On two GPUs, tests/test_gpu_tp.py checks it against NCCL, also inside a CUDA graph."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels.all_reduce import NPROG, buffer_bytes, one_shot_all_reduce

W, SLOT = 2, 1 << 15


def flags(buf: torch.Tensor) -> torch.Tensor:
    return buf[2 * W * SLOT:].view(torch.int32).view(NPROG, W)      # [program, source rank]


def received(buf: torch.Tensor, slot: int, src: int, like: torch.Tensor) -> torch.Tensor:
    at = (slot * W + src) * SLOT
    return buf[at:at + like.numel() * like.element_size()].view(like.dtype)


@pytest.mark.parametrize("dtype,n", [(torch.float32, 4097), (torch.float16, 3)])
def test_one_shot_all_reduce_two_ranks(dtype, n):
    mem = [torch.zeros(buffer_bytes(W, SLOT), dtype=torch.uint8) for _ in range(W)]
    bufs = torch.tensor([m.data_ptr() for m in mem], dtype=torch.int64)
    parity = [torch.zeros(NPROG, dtype=torch.int32) for _ in range(W)]
    abort = torch.zeros(1, dtype=torch.int32)
    g = torch.Generator().manual_seed(n)
    for call in range(3):
        x = [torch.randn(n, generator=g).to(dtype) for _ in range(W)]
        want = (x[0].float() + x[1].float()).to(dtype)
        slot = call % 2
        received(mem[0], slot, 1, x[1]).copy_(x[1])                  # rank 1's push and flags
        flags(mem[0])[:, 1] = 1
        y0, y1 = x[0].clone(), x[1].clone()
        one_shot_all_reduce(y0, bufs, parity[0], abort, 0, W, SLOT)
        assert (flags(mem[0]) == 0).all()                             # rank 0 took rank 1's flags
        assert (flags(mem[1])[:, 0] == 1).all()                       # and raised its own at rank 1
        assert torch.equal(received(mem[1], slot, 0, x[0]), x[0])      # its copy in rank 1's slot of this call
        one_shot_all_reduce(y1, bufs, parity[1], abort, 1, W, SLOT)
        assert (flags(mem[1]) == 0).all()
        flags(mem[0])[:, 1] = 0                                       # rank 1's flags of this call, set by hand above
        assert torch.equal(y0, want) and torch.equal(y1, want)
    assert (parity[0] == 1).all() and (parity[1] == 1).all()          # three calls: each program's count is odd


ABORT = """
import threading
import torch
from engine.kernels.all_reduce import NPROG, buffer_bytes, one_shot_all_reduce
W, SLOT = 2, 1 << 15
mem = [torch.zeros(buffer_bytes(W, SLOT), dtype=torch.uint8) for _ in range(W)]
bufs = torch.tensor([m.data_ptr() for m in mem], dtype=torch.int64)
abort = torch.zeros(1, dtype=torch.int32)
peer_flags = mem[1][2 * W * SLOT:].view(torch.int32).view(NPROG, W)


def set_abort_once_waiting():                   # program 0 signalled rank 1, so it now waits for rank 1's flag
    while peer_flags[0, 0].item() != 1:
        pass
    abort[0] = 1


t = threading.Thread(target=set_abort_once_waiting)
t.start()
one_shot_all_reduce(torch.ones(8), bufs, torch.zeros(NPROG, dtype=torch.int32), abort, 0, W, SLOT, spin_check=1)
t.join()
assert (peer_flags[:, 0] == 1).all()            # every program signalled, then gave up waiting
print("returned")
"""


def test_one_shot_all_reduce_abort_ends_the_wait():
    """A peer that never raises its flag: the abort word, set while the kernel waits, ends every program's wait
    (run apart, so that a wait that never ends fails the test instead of holding the suite)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", ABORT], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and "returned" in out.stdout, out.stderr[-2000:]

COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.all_reduce import BLOCK, _one_shot_all_reduce_kernel
sig = {"x_ptr": "*bf16", "n": "i32", "bufs_ptr": "*i64", "parity_ptr": "*i32", "abort_ptr": "*i32",
       **dict.fromkeys(("RANK", "WORLD", "SLOT_BYTES", "FLAGS_AT", "BLOCK", "SPIN_CHECK"), "constexpr")}
const = dict(RANK=1, WORLD=2, SLOT_BYTES=1 << 23, FLAGS_AT=4 << 23, BLOCK=BLOCK, SPIN_CHECK=256)
try:
    k = triton.compile(ASTSource(_one_shot_all_reduce_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8})
except RuntimeError as e:          # no ptxas in this Triton build
    print("SKIP", e)
else:
    print(k.asm["ptx"])
"""


def test_one_shot_all_reduce_compiles_for_hopper():
    """The interpreter runs code the compiler refuses: compile it for sm_90 in a process without the interpreter,
    and check the flags' ordering: raised with release, taken with acquire, both at system scope."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout)
    assert "atom.global.release.sys.cas.b32" in out.stdout and "atom.global.acquire.sys.cas.b32" in out.stdout
