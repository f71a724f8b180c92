"""The Triton kernels compiled for a Hopper GPU (sm_90) on this CPU machine.

TRITON_INTERPRET=1 runs kernels as Python, so it never meets the compiler's own rules (one type for every
`return` of a jitted function, layout and shape checks). Compiling to a cubin needs no GPU, only Triton's
bundled ptxas. The kernels are compiled in a child process with the interpreter off (under it, `triton.jit`
gives interpreted functions), at the launch configurations their wrappers choose.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

pytestmark = pytest.mark.slow

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {"w_ptr": "*i8", "s_ptr": "*fp32", "z_ptr": "*fp32", "cs_ptr": "*fp32", "pos_ptr": "*i64",
            "slot_ptr": "*i64", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_q_ptr": "*i32", "lse_ptr": "*fp32"}
FLOATS = {"eps", "qk_scale"}


def compile_sm90(kernel, constexprs: dict, pointers: dict | None = None, aligned: tuple[str, ...] = (),
                 **options) -> None:
    """Compile `kernel` with these constexprs; pointers default to bf16, other run-time arguments to i32.
    aligned: integer arguments known to be multiples of 16 (with every pointer 16-byte aligned), as Triton
    specialises them at launch: what lets the pipeliner use async copies. options: num_warps, num_stages."""
    ptrs = dict(POINTERS, **(pointers or {}))
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptrs.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    missing = [n for n, p in zip(kernel.arg_names, kernel.params) if p.is_constexpr and n not in constexprs]
    assert not missing, f"constexprs not given: {missing}"
    attrs = None
    if aligned:
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                 if n in aligned or (n.endswith("_ptr") and n not in constexprs)}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=TARGET, options=options or None)


def check_quant_gemv(fmt, block_m):
    from engine.kernels import quant_gemv
    for (f, N, K), (bn, bk, _warps, cvt, pre) in quant_gemv.QUANT_GEMV_CONFIGS.items():
        if f != fmt:
            continue
        base = dict(PROLOGUE=1, HAS_BIAS=False, HAS_RES=True, USE_PDL=True, CVT=cvt, PRE=bool(pre),
                    BLOCK_M=block_m, BLOCK_N=bn)
        if fmt == "int4":
            compile_sm90(quant_gemv._gemv_w4_kernel, dict(base, HALF=16, NG=bk // 32))
        else:
            compile_sm90(quant_gemv._gemv_w8_kernel,
                         dict(base, FMT=quant_gemv.FMT_IDS[fmt], BLOCK=128, BLOCK_K=bk))
        break                                   # one shape per format: the configs differ only in sizes


def check_quant_gemv_tc(fmt, block_m, dot):
    """The tensor-core GEMV at the rule's config, aligned as the 8B shapes launch it (pipelined loads)."""
    import triton.language as tl
    from engine.kernels import quant_gemv_tc as q
    bn, bk, warps, stages, _ = q.quant_gemv_tc_config(fmt, block_m, 4096, 4096)
    dt = tl.float16 if dot & 1 else tl.bfloat16
    ptrs = {"w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16"} if fmt == "int4" else None
    for prologue in (1, 2):
        compile_sm90(q._gemv_tc_kernel,
                     dict(FMT=q.TC_FMT_IDS[fmt], PROLOGUE=prologue, HAS_BIAS=prologue == 1, HAS_RES=prologue == 2,
                          USE_PDL=True, IEEE=False, DT=dt, OFF=q.code_offset(fmt, dt), BLOCK=128,
                          HALF=64 if fmt == "int4" else 1, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
                          ASM=bool(dot & 2)),
                     ptrs, aligned=("N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om"),
                     num_warps=warps, num_stages=stages)


def check_quant_gemv_packed(fmt, block_m, flags, split, rows=False):
    """The packed-word GEMV (its inline-PTX decodes: flags bit 0) at the rule's config, 8B-like alignment; rows: the
    rows on the grid (ROWS, launched at BLOCK_M = 1)."""
    from engine.kernels import quant_gemv_packed as q
    from engine.kernels.quant_packed_configs import quant_gemv_packed_config
    bn, bk, warps, _, _ = quant_gemv_packed_config(fmt, block_m, 4096, 4096)
    int4 = fmt == "int4"
    ptrs = {"w_ptr": "*i32", "s_ptr": "*fp16" if int4 else "*fp32", "z_ptr": "*fp16" if int4 else "*fp32",
            "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    for prologue in (1, 2):
        compile_sm90(q._pk_gemv_kernel,
                     dict(FMT=q.PK_FMT_IDS[fmt], PROLOGUE=prologue, HAS_BIAS=prologue == 1, HAS_RES=prologue == 2,
                          USE_PDL=True, ASM=bool(flags & 1), PRE=bool(flags & 2), SPLIT=split, BLOCK=128,
                          S=16 if int4 else 1, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, ROWS=rows),
                     ptrs, aligned=("N", "K", "stride_xm", "stride_wn", "stride_rm", "stride_om"), num_warps=warps)


def check_quant_gemv_packed_workspace_order(fmt, block_m, rows=False):
    """Split-K's last program: a CTA barrier between its reads of the workspace (the sums and the rms_norm squares,
    copies of which several warps hold) and the stores that zero it; without one a warp read a square another had
    zeroed already (H200: fp8, M = 4, rms_norm, split 2, two warps: the second call off by 69x)."""
    import re
    from engine.kernels import quant_gemv_packed as q
    int4 = fmt == "int4"
    ptrs = {"w_ptr": "*i32", "s_ptr": "*fp16" if int4 else "*fp32", "z_ptr": "*fp16" if int4 else "*fp32",
            "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    k = compile_sm90(q._pk_gemv_kernel,
                     dict(FMT=q.PK_FMT_IDS[fmt], PROLOGUE=1, HAS_BIAS=False, HAS_RES=True, USE_PDL=False, ASM=False,
                          PRE=False, SPLIT=2, BLOCK=128, S=16 if int4 else 1, BLOCK_M=block_m, BLOCK_N=32,
                          BLOCK_K=256 if int4 else 128, ROWS=rows), ptrs, num_warps=2)
    lines = k.asm["ptx"].splitlines()
    start = next(i for i, ln in enumerate(lines) if "atom.global" in ln and "acq_rel" in ln)
    tail = lines[start:]
    last_ld = max(i for i, ln in enumerate(tail) if "ld.global.cg" in ln)
    first_st = min(i for i, ln in enumerate(tail) if re.search(r"\bst\.global", ln))
    assert last_ld < first_st and any("bar.sync" in ln for ln in tail[last_ld:first_st]), \
        f"{fmt} BLOCK_M={block_m}: workspace zeroed (line {first_st}) before / without a barrier after its last read " \
        f"(line {last_ld})"


def check_quant_gemm_int4_group_dots():
    from engine.kernels import quant_gemm
    for bm, bn, warps, stages in (quant_gemm.quant_gemm_config(16), quant_gemm.quant_gemm_config(128)):
        compile_sm90(quant_gemm._gemm_w4_words_kernel,
                     dict(HAS_BIAS=False, IEEE=False, S=16, BLOCK_M=bm, BLOCK_N=bn, DOTS=True),
                     {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16"}, aligned=("K", "stride_xm", "stride_wn"),
                     num_warps=warps, num_stages=stages)


def check_fp8_gemm_two_launch():
    """kernels/quant_gemm_fp8.py: the per-token-group activation quantization and the FP8 GEMM at each row count's
    rule config, aligned as the 8B shapes launch them (pipelined loads)."""
    from engine.kernels import quant_gemm_fp8 as q
    compile_sm90(q._act_quant_fp8_kernel, dict(FMAX=448.0, BLOCK_M=8, BLOCK_K=128), {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                 aligned=("K", "stride_xm", "stride_qm", "stride_sk"), num_warps=4)
    for M in (16, 64, 256):
        bm, bn, warps, stages = q.gemm_fp8_config(M)
        compile_sm90(q._gemm_fp8_kernel, dict(HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128),
                     {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"},
                     aligned=("N", "K", "stride_am", "stride_ask", "stride_wn", "stride_om"), num_warps=warps,
                     num_stages=stages)


def check_quant_qkv_rope_packed(fmt, block_m):
    from engine.kernels import quant_qkv_rope
    import triton.language as tl
    ptrs = {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16"} if fmt == 2 else {"w_ptr": "*i32"}
    compile_sm90(quant_qkv_rope._qkv_rope_quant_kernel,
                 dict(FMT=fmt, D=128, BLOCK_SIZE=16, HAS_BIAS=False, USE_PDL=True, CVT=0, PRE=True, BLOCK=128,
                      HALF_G=64 if fmt == 2 else 1, BLOCK_M=block_m, BLOCK_K=1024 if fmt == 2 else 512, P=8,
                      TC=False, DT=tl.float32, OFF=0.0, PK=True, ASM=True), ptrs)


def check_quant_qkv_rope(fmt, block_m):
    from engine.kernels import quant_qkv_rope
    import triton.language as tl
    base = dict(FMT=fmt, D=64, BLOCK_SIZE=16, HAS_BIAS=True, USE_PDL=True, CVT=0, PRE=True, BLOCK=128,
                HALF_G=32 if fmt == 2 else 1, BLOCK_M=block_m, BLOCK_K=256, PK=False, ASM=False)
    compile_sm90(quant_qkv_rope._qkv_rope_quant_kernel, dict(base, P=2, TC=False, DT=tl.float32, OFF=0.0))
    tc = dict(base, P=8, TC=True, DT=tl.float16, OFF=1024.0 if fmt == 2 else 0.0, BLOCK_M=1 if block_m == 1 else 16)
    compile_sm90(quant_qkv_rope._qkv_rope_quant_kernel, tc, aligned=("K", "stride_xm", "stride_wn"), num_warps=2,
                 num_stages=4)


def check_bf16_decode(block_m):
    from engine.kernels import gemv, qkv_rope
    for pre in (False, True):
        compile_sm90(gemv._gemv_kernel, dict(PROLOGUE=2, HAS_BIAS=False, HAS_RES=True, USE_PDL=True,
                                             BLOCK_M=block_m, BLOCK_N=8, BLOCK_K=512, PRE=pre))
    compile_sm90(gemv._gemv_persistent_kernel, dict(PROLOGUE=1, HAS_BIAS=False, HAS_RES=False, USE_PDL=False,
                                                    BLOCK_M=block_m, BLOCK_N=2, BLOCK_K=4096, DEPTH=1),
                 {"w_ptr": "*bf16"}, num_warps=4)
    compile_sm90(qkv_rope._qkv_rope_kernel, dict(D=64, P=2, BLOCK_SIZE=16, HAS_BIAS=False, USE_PDL=True,
                                                 BLOCK_M=block_m, BLOCK_K=512))


def check_paged_attention():
    from engine.kernels import decode_attention, paged_attention
    compile_sm90(paged_attention._prefill_kernel,
                 dict(G=4, GP=4, BQ=32, BLOCK_M=128, BLOCK_N=64, BLOCK_SIZE=16, D=64, BD=64, SKIP_DECODES=True,
                      DOT_PREC="tf32", F16_DOT=False))
    compile_sm90(paged_attention._prefill_kernel,                  # an fp8 cache, products in fp16
                 dict(G=4, GP=4, BQ=32, BLOCK_M=128, BLOCK_N=64, BLOCK_SIZE=16, D=128, BD=128, SKIP_DECODES=True,
                      DOT_PREC="tf32", F16_DOT=True),
                 {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}, num_warps=8, num_stages=3)
    compile_sm90(decode_attention._decode_kernel,
                 dict(G=4, BLOCK_M=16, BLOCK_N=64, BLOCK_SIZE=16, D=64, BD=64, NUM_SPLITS=4, VARLEN=True,
                      DOT_PREC="tf32", F16_DOT=False, USE_PDL=True))
    compile_sm90(decode_attention._decode_kernel,                  # an fp8 cache, products in fp16
                 dict(G=4, BLOCK_M=16, BLOCK_N=128, BLOCK_SIZE=16, D=128, BD=128, NUM_SPLITS=1, VARLEN=False,
                      DOT_PREC="tf32", F16_DOT=True, USE_PDL=False),
                 {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}, num_warps=4, num_stages=2)


CHECKS = [(check_quant_gemv, a) for a in itertools.product(["int8", "fp8", "int4"], [1, 4])] + \
         [(check_quant_gemv_tc, a) for a in itertools.product(["int8", "fp8", "int4"], [1, 16], [0, 1])] + \
         [(check_quant_gemv_tc, ("int4", m, d)) for m in (1, 16) for d in (2, 3)] + \
         [(check_quant_qkv_rope, a) for a in itertools.product([0, 1, 2], [1, 4])] + \
         [(check_quant_gemv_packed, (f, m, fl, sp)) for f in ("int4", "int8", "fp8") for m, fl, sp in
          ((1, 1, 1), (1, 3, 2), (1, 0, 1), (4, 1, 2))] + \
         [(check_quant_gemv_packed, ("int4", 1, fl, 4, True)) for fl in (0, 3)] + \
         [(check_quant_gemv_packed_workspace_order, a) for a in (("fp8", 4), ("int8", 1), ("int4", 1, True))] + \
         [(check_quant_qkv_rope_packed, a) for a in itertools.product([0, 1, 2], [1, 4])] + \
         [(check_quant_gemm_int4_group_dots, ()), (check_fp8_gemm_two_launch, ())] + \
         [(check_bf16_decode, (1,)), (check_bf16_decode, (4,)), (check_paged_attention, ())]


def main() -> int:
    failed = 0
    for fn, args in CHECKS:
        try:
            fn(*args)
        except Exception as e:                  # report every failing kernel, not only the first
            failed += 1
            print(f"FAILED {fn.__name__}{args}: {type(e).__name__}: {e}", file=sys.stderr)
    return 1 if failed else 0


def test_kernels_compile_for_sm90():
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


if __name__ == "__main__":
    sys.exit(main())
