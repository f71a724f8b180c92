"""qkv_rope.py's fused decode q/k/v projection (RMSNorm prologue, RoPE and the paged-KV store in the epilogue)
over quantized weights: the dot is quant_gemv.py's (its int8 / fp8 / int4 tile decodes and launch configs),
the epilogue is qkv_rope.py's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.formats import BLOCK, dequantize, int4_group
from engine.kernels import torch_ops
from engine.kernels.qkv_rope import _rope_store
from engine.kernels.quant_gemv import FMT_IDS, _w4_dot, _w8_dot, quant_gemv_config
from engine.kernels.quant_gemv_packed import _pk_w4_dot, _pk_w8_dot, pk_tensors
from engine.kernels.quant_packed_configs import quant_gemv_packed_config
from engine.kernels.quant_gemv_tc import DM, _tc_dot, code_offset, quant_gemv_tc_config, tc_dtype


@triton.jit
def _qkv_rope_quant_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr,
                           slot_ptr, M, N, K, G, H, Hk, stride_xm, stride_wn, stride_sn, stride_qm, stride_cs,
                           stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, eps,
                           FMT: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, CVT: tl.constexpr, PRE: tl.constexpr,
                           BLOCK: tl.constexpr, HALF_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           TC: tl.constexpr, DT: tl.constexpr, OFF: tl.constexpr, PK: tl.constexpr = False,
                           ASM: tl.constexpr = False):
    """qkv_rope.py's kernel over quantized weights (FMT 0 int8, 1 fp8, 2 int4): a program's 2P rows are P rotation
    pairs (j, j + D/2) of one head, interleaved, so the dot's [BM, 2P] splits into the pair's halves.
    TC: quant_gemv_tc.py's tensor-core dot (2P >= 16 rows; DT, OFF its dtype and code offset; CVT, PRE unused).
    PK: quant_gemv_packed.py's dot over int32 words (int4 in the words layout; ASM its packed decode, PRE)."""
    HALF: tl.constexpr = D // 2
    pid = tl.program_id(0)
    head = pid // (HALF // P)                                   # 0..H-1 q, H..H+Hk-1 k, then v
    j0 = (pid % (HALF // P)) * P
    j = j0 + tl.arange(0, P)                                    # [P] first-half dims of this program's pairs
    i = tl.arange(0, 2 * P)
    offs_n = head * D + j0 + i // 2 + (i % 2) * HALF            # [2P] rows j, j + D/2, j + 1, ...
    if TC:
        offs_m = tl.arange(0, DM)
    else:
        offs_m = tl.arange(0, BLOCK_M)
    mm, nm = offs_m < M, offs_n < N
    if TC:
        s_row = s_ptr + ((head * D + j0) // BLOCK).to(tl.int64) * stride_sn    # fp8: D divides 128
        acc, ss = _tc_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, s_row, M, K, G, stride_xm, stride_wn,
                          stride_sn, FMT, 1, USE_PDL, False, DT, OFF, BLOCK, HALF_G, BLOCK_M, 2 * P, BLOCK_K)
    elif PK and FMT == 2:
        acc, ss = _pk_w4_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, 0, G, M, K, stride_xm, stride_wn,
                             stride_sn, 1, USE_PDL, ASM, PRE, HALF_G // 4, BLOCK_M, 2 * P, BLOCK_K // (2 * HALF_G))
    elif PK:
        s_row = s_ptr + ((head * D + j0) // BLOCK).to(tl.int64) * stride_sn    # fp8: D divides 128
        acc, ss = _pk_w8_dot(x_ptr, w_ptr, s_ptr, nw_ptr, offs_n, nm, s_row, 0, K // 4, M, K, stride_xm, stride_wn,
                             stride_sn, FMT, 1, USE_PDL, ASM, PRE, BLOCK, BLOCK_M, 2 * P, BLOCK_K)
    elif FMT == 2:
        acc, ss = _w4_dot(x_ptr, w_ptr, s_ptr, z_ptr, nw_ptr, offs_n, nm, M, K, G, stride_xm, stride_wn, stride_sn,
                          1, USE_PDL, CVT, PRE, HALF_G, BLOCK_M, 2 * P, BLOCK_K // (2 * HALF_G))
    else:
        s_row = s_ptr + ((head * D + j0) // BLOCK).to(tl.int64) * stride_sn    # fp8: D divides 128
        acc, ss = _w8_dot(x_ptr, w_ptr, s_ptr, nw_ptr, offs_n, nm, s_row, M, K, stride_xm, stride_wn, stride_sn,
                          FMT, 1, USE_PDL, CVT, PRE, BLOCK, BLOCK_M, 2 * P, BLOCK_K)
    acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    x1, x2 = tl.split(tl.reshape(acc, (offs_m.shape[0], P, 2)))     # [BM, P] each
    _rope_store(x1, x2, head, j, offs_m, mm, H, Hk, q_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr,
                stride_qm, stride_cs, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                D, BLOCK_SIZE)


def qkv_rope_supported(fmt: str, head_dim: int) -> bool:
    """Whether quant_fused_qkv_rope_store takes this head size (fp8: a head's rows lie in one 128-row block)."""
    return head_dim % 2 == 0 and (fmt != "fp8" or BLOCK % head_dim == 0)


def quant_fused_qkv_rope_store(x: torch.Tensor, fmt: str, qt: dict[str, torch.Tensor], shape: tuple[int, int],
                               bias: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, num_heads: int,
                               num_kv_heads: int, positions: torch.Tensor, cos_sin: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               pdl: bool = False, tensor_cores: bool = False, packed: bool = False,
                               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """qkv_rope.fused_qkv_rope_store over the quantized q/k/v weight qt ([N, K] = shape): x [M, K] residual
    stream -> q [M, H, D] = RoPE(RMSNorm(x) @ Wq.T); RoPE(k) and v into the caches at flat slots (negative:
    skipped). tensor_cores: quant_gemv_tc.py's dot (M <= 16, head_dim a multiple of 32; see
    qkv_rope_supported). config: quant_gemv_config's or (tensor cores) quant_gemv_tc_config's tuple; its BLOCK_N
    is replaced by the program's 2 P rows. packed: quant_gemv_packed.py's dot (config: its tuple; 2 P = its
    BLOCK_N where that divides the head's rotation pairs; no split-K)."""
    M, K = x.shape
    N = shape[0]
    D = N // (num_heads + 2 * num_kv_heads)
    assert N == (num_heads + 2 * num_kv_heads) * D and shape[1] == K and x.stride(-1) == 1
    assert qkv_rope_supported(fmt, D), (fmt, D)
    assert cos_sin.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = torch.empty((M, num_heads, D), dtype=x.dtype, device=x.device)
    if M == 0:
        return q
    half = D // 2
    asm = False
    if packed and not tensor_cores:
        bn, bk, warps, _, flags = config or quant_gemv_packed_config(fmt, M, N, K)
        P = max(1, min(bn // 2, half))
        while half % P:
            P //= 2
        cvt, pre, stages, dt = 0, bool(flags & 2), 1, tl.float32
        asm = bool(flags & 1) and (fmt != "int4" or x.dtype == torch.bfloat16)
        w, s, z, group = pk_tensors(fmt, qt)
        if fmt == "int4":
            assert bk % group == 0, f"int4 BLOCK_K {bk} must be a multiple of the group size {group}"
            fmt_id, G = 2, s.shape[1]
        else:
            fmt_id, G, group = FMT_IDS[fmt], 0, 2
    elif tensor_cores:
        assert M <= DM and half % 16 == 0, (M, D)
        P = 8                                                   # 2P = 16 rows: one tensor-core tile wide
        _, bk, warps, stages, dot = config or quant_gemv_tc_config(fmt, M, N, K)
        warps = min(warps, 2)                                   # 16 rows: at most two 8-wide mma tiles
        cvt, pre, dt = 0, 0, tc_dtype(x.dtype, dot & 1)     # int4's packed decode: not here
    else:
        P = 2 if half % 2 == 0 else 1                           # rotation pairs per program
        _, bk, warps, cvt, pre = config or quant_gemv_config(fmt, M, N, K)
        stages, dt = 1, tl.float32
    if packed and not tensor_cores:
        pass
    elif fmt == "int4":
        w, s, z = qt["qweight"], qt["scales"], qt["mins"]
        group = int4_group(qt)
        bk = bk if config else max(bk, group)
        assert bk % group == 0, f"int4 BLOCK_K {bk} must be a multiple of the group size {group}"
        fmt_id, G = 2, s.shape[1]
    else:
        w = qt["weight"].view(torch.int8)
        s = qt["weight_scale"] if fmt == "int8" else qt["weight_scale_inv"]
        z, group, fmt_id, G = s, 2, FMT_IDS[fmt], 0
    _qkv_rope_quant_kernel[((num_heads + 2 * num_kv_heads) * (half // P),)](
        x, w, s, z, bias if bias is not None else x, norm_weight, q, k_cache, v_cache, positions, cos_sin,
        slot_mapping, M, N, K, G, num_heads, num_kv_heads, x.stride(0), w.stride(0), s.stride(0), q.stride(0),
        cos_sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], eps,
        FMT=fmt_id, D=D, P=P, BLOCK_SIZE=k_cache.shape[1], HAS_BIAS=bias is not None, USE_PDL=pdl, CVT=cvt,
        PRE=pre, BLOCK=BLOCK, HALF_G=group // 2,
        BLOCK_M=(1 if M == 1 else DM) if tensor_cores else max(1, triton.next_power_of_2(M)), BLOCK_K=bk,
        TC=tensor_cores, DT=dt, OFF=code_offset(fmt, dt) if tensor_cores else 0.0, PK=packed and not tensor_cores,
        ASM=asm, num_warps=warps,
        num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return q


def quant_fused_qkv_rope_store_ref(x, fmt, qt, shape, bias, norm_weight, eps, num_heads, num_kv_heads, positions,
                                   cos_sin, k_cache, v_cache, slot_mapping, pdl=False, tensor_cores=False,
                                   packed=False):
    """Dequantize, then torch_ops.fused_qkv_rope_store."""
    return torch_ops.fused_qkv_rope_store(x, dequantize(fmt, qt, shape, x.dtype), bias, norm_weight, eps, num_heads,
                                          num_kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping)
