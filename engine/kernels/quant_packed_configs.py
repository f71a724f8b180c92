"""The packed-word GEMV's launch configs (kernels/quant_gemv_packed.py): the swept table per (format, N, K), the rule
for other shapes, the row placement at M > 1 and which formats / sizes the kernel takes."""
from __future__ import annotations

import os

import triton

# (format, N, K) -> (BLOCK_N, BLOCK_K, num_warps, SPLIT, FLAGS) at M = 1 (FLAGS bit 0 ASM, bit 1 PRE):
# benchmarks/sweep_quant_gemv.py --quick --kernels packed on an H200 (us at M = 1 in the comments; the earlier
# kernels' best, CUDA / tensor cores, from the README in brackets; int4 from a second sweep, after the centred
# decode)
QUANT_GEMV_PACKED_CONFIGS: dict[tuple[str, int, int], tuple[int, int, int, int, int]] = {
    # Llama-3.1-8B: qkv, o, gate_up, down
    ("fp8", 6144, 4096): (16, 256, 1, 4, 1),        # 12.6 (13.1)
    ("int8", 6144, 4096): (16, 256, 1, 4, 1),       # 13.1 (12.9 tensor cores: kept there)
    ("int4", 6144, 4096): (16, 512, 1, 4, 1),       # 11.2 (14.0)
    ("fp8", 4096, 4096): (32, 512, 2, 4, 1),        # 8.2 (8.9)
    ("int8", 4096, 4096): (32, 512, 2, 4, 1),       # 8.5 (9.4)
    ("int4", 4096, 4096): (32, 512, 2, 4, 3),       # 7.4 (9.3)
    ("fp8", 28672, 4096): (16, 512, 1, 1, 1),       # 36.5 (34.9 tensor cores: kept there)
    ("int8", 28672, 4096): (16, 512, 1, 1, 3),      # 40.5 (40.1 tensor cores: kept there)
    ("int4", 28672, 4096): (16, 512, 1, 1, 3),      # 31.7 (54.4)
    ("fp8", 4096, 14336): (64, 512, 4, 4, 1),       # 19.5 (26.6)
    ("int8", 4096, 14336): (32, 512, 2, 4, 1),      # 21.1 (28.3)
    ("int4", 4096, 14336): (32, 512, 2, 4, 3),      # 18.1 (31.6)
}


def packed_supported(fmt: str, K: int) -> bool:
    """int8 / fp8 words need K % 4 == 0 (rows of whole words); int4 takes any K (the words layout pads to G)."""
    return fmt == "int4" or (fmt in ("int8", "fp8") and K % 4 == 0)


def quant_gemv_packed_config(fmt: str, M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, SPLIT, FLAGS): the swept entry, else the 8B winners' pattern: 512 weights a
    step; N > 8192 (qkv, gate_up): 16 rows a one-warp program, no split; else (o, down) 32 rows on two warps and
    4-way split-K; the packed (ASM) decode where compiled (int4 with the early load)."""
    cfg = QUANT_GEMV_PACKED_CONFIGS.get((fmt, N, K))
    if cfg is None:
        flags = 0 if _interpreted() else (3 if fmt == "int4" else 1)
        cfg = (16, 512, 1, 1, flags) if N > 8192 else (32, 512, 2, 4, flags)
    bn, bk, warps, split, flags = cfg
    if M > 1 and not rows_on_grid_default(fmt):     # activation rows live beside the weights (int4: the rows on
        bk = max(256, bk // triton.next_power_of_2(M))   # the grid, each program the M = 1 dot at its M = 1 tiles)
    return bn, bk, warps, split, flags



def rows_on_grid_default(fmt: str) -> bool:
    """int4 at M > 1: the rows on the grid, each program the M = 1 dot (verified on the H200 at M = 4 on every 8B
    projection at the engine's configs, both decodes), not the shared-row int4 dot (BLOCK_M > 1), which has not
    run on a GPU since the split-K zeroing race was fixed (tests/test_gpu_quant_packed.py's xfail diagnostic
    says when it does). int8 / fp8 keep their rows in one program (decoded once for all rows; M = 4 verified)."""
    return fmt == "int4"


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
