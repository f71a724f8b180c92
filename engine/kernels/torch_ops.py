"""Plain-torch implementations of every kernel the model calls: the CPU path and the tests' reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels
from engine.kernels.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out = RMSNorm(x + residual) * weight; returns (out, x + residual) (the new residual)."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * out.to(x.dtype), residual


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, nH, D] (a view) <- RMSNorm over D * weight, in place; returns x."""
    return x.copy_(rms_norm(x, weight, eps)[0])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 prologue: str | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 residual: torch.Tensor | None = None, pdl: bool = False, variant: str = "auto") -> torch.Tensor:
    """prologue(x) @ weight.T (+ bias) (+ residual); prologue None, "rms_norm" (x [M, K], RMSNorm with
    norm_weight) or "silu_mul" (x [M, 2K] = gate | up). The unfused composition the Triton GEMV fuses
    (pdl and variant, launch options of the Triton kernel, mean nothing here)."""
    if prologue == "rms_norm":
        x = rms_norm(x, norm_weight, eps)[0]
    elif prologue == "silu_mul":
        x = silu_and_mul(x)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def fused_qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         norm_weight: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                         positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """RMSNorm(x) @ weight.T split into q, k, v; RoPE on q and k; k, v stored into the caches; -> q [M, H, D]."""
    M = x.shape[0]
    D = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    qkv = fused_linear(x, weight, bias, prologue="rms_norm", norm_weight=norm_weight, eps=eps)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k, v = q.view(M, num_heads, D), k.view(M, num_kv_heads, D), v.view(M, num_kv_heads, D)
    rope_and_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    return q


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, pdl: bool = False) -> None:
    """apply_rope on q (in place) and k, then store k and v into the paged caches (k itself may stay unrotated).
    pdl (programmatic dependent launch, a Triton launch option) means nothing here, as in paged_attention."""
    apply_rope(q, k, positions, cos_sin)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> None:
    """In place, neox/HF style (rotate halves). q [T, H, D], k [T, Hk, D], cos_sin [max_pos, D] (cos | sin)."""
    cs = cos_sin.index_select(0, positions)               # [T, D]
    cos, sin = cs.chunk(2, dim=-1)                         # [T, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)          # [T, 1, D/2]
    for t in (q, k):
        x1, x2 = t.float().chunk(2, dim=-1)
        t.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0


def kv_encode(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K/V values -> what a cache of cache_dtype stores: fp8 e4m3 codes at scale 1.0 (saturated at +-448,
    rounded to nearest even), else x itself."""
    if cache_dtype != FP8_KV:
        return x
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)


def kv_decode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached K/V (codes of an fp8 cache, or values) -> values in dtype."""
    return x.to(dtype)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hk, D] into caches [num_blocks, block_size, Hk, D] at flat slots (negative = skip); an fp8
    cache gets e4m3 codes (kv_encode)."""
    kc = k_cache.view(-1, *k_cache.shape[2:])              # [num_blocks*block_size, Hk, D]
    vc = v_cache.view(-1, *v_cache.shape[2:])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k, v = kv_encode(k, kc.dtype), kv_encode(v, vc.dtype)
    if kc.dtype == FP8_KV:                                 # index_copy_ has no fp8 kernel: copy the bytes
        kc, vc, k, v = kc.view(torch.uint8), vc.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    kc.index_copy_(0, slot_mapping, k)
    vc.index_copy_(0, slot_mapping, v)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hk, D], block_ids [..., nb] -> [..., nb * bs, Hk, D] (index_select on whole blocks: a
    plain row copy, ~2x faster on CPU than advanced indexing)."""
    N, bs, Hk, D = cache.shape
    rows = cache.view(N, bs * Hk * D).index_select(0, block_ids.reshape(-1))          # int32 or int64 ids
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * bs, Hk, D)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [N, bs, Hk, D], block_table [nb] -> [length, Hk, D]."""
    bs = cache.shape[1]
    nb = (length + bs - 1) // bs
    return _gather_blocks(cache, block_table[:nb])[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float, pdl: bool = False) -> torch.Tensor:
    """Causal attention of packed varlen queries over each sequence's paged KV (pdl, a launch option of the
    Triton kernels, means nothing here).

    q [T, H, D]; caches [num_blocks, block_size, Hk, D] already hold this step's K/V (fp8 codes are upcast
    to q's dtype as they are gathered). Returns [T, H, D].
    A sequence's queries are its last q_len positions of its seq_len context.
    """
    T, H, D = q.shape
    Hk = k_cache.shape[2]
    g = H // Hk
    out = torch.empty_like(q)
    dec_seqs: list[int] = []
    cu = 0
    for i, (ql, sl) in enumerate(zip(md.q_lens, md.seq_lens_cpu)):
        if ql == 0:                                            # an unused slot of a padded (graph) batch
            continue
        if ql == 1:
            dec_seqs.append(i)
        else:
            k = kv_decode(_gather_kv(k_cache, md.block_tables[i], sl), q.dtype)  # [S, Hk, D]
            v = kv_decode(_gather_kv(v_cache, md.block_tables[i], sl), q.dtype)
            qi = q[cu:cu + ql]                                 # [ql, H, D]
            # causal with offset: query j (absolute pos sl-ql+j) sees keys 0..sl-ql+j
            mask = torch.ones(ql, sl, dtype=torch.bool, device=q.device).tril(sl - ql)
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=g > 1)   # [H, ql, D]
            out[cu:cu + ql] = o.transpose(0, 1)
        cu += ql
    if dec_seqs:
        if len(dec_seqs) == md.num_seqs:
            tok_idx = None
            bt, lens = md.block_tables, md.seq_lens
        else:
            sel = torch.tensor(dec_seqs, device=q.device)
            tok_idx = md.cu_seqlens_q[:-1].long()[sel]
            bt, lens = md.block_tables[sel], md.seq_lens[sel]
        qd = q if tok_idx is None else q[tok_idx]                  # [Bd, H, D]
        if q.device.type == "cpu" and cpu_kernels.loaded():     # the C++ kernel, with nothing to store
            none = qd.new_empty((0, Hk, D))
            o = torch.ops.kvscope.decode_attention.default(qd, none, none, k_cache, v_cache, _NO_SLOTS, bt, lens,
                                                           scale)
        else:
            o = _decode_attention(qd, k_cache, v_cache, bt, lens, [md.seq_lens_cpu[i] for i in dec_seqs], scale)
        if tok_idx is None:
            out.copy_(o)
        else:
            out[tok_idx] = o
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      lens: torch.Tensor, lens_cpu: list[int], scale: float) -> torch.Tensor:
    """One query per sequence: q [B, H, D], block_tables [B, >= blocks of the longest], lens [B] (and on the
    host) -> [B, H, D]."""
    max_len = max(lens_cpu)
    bs = k_cache.shape[1]
    nb = (max_len + bs - 1) // bs
    bt = block_tables[:, :nb]                                          # [B, nb]
    k = _gather_blocks(k_cache, bt)[:, :max_len]                       # [B, S, Hk, D]
    v = _gather_blocks(v_cache, bt)[:, :max_len]
    if k.dtype != q.dtype:
        k, v = kv_decode(k, q.dtype), kv_decode(v, q.dtype)
    mask = None                                  # all lengths equal (batch 1): no mask, so SDPA takes its fused kernel
    if min(lens_cpu) < max_len:
        mask = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),                                                # [B, H, 1, D]
        k.transpose(1, 2), v.transpose(1, 2),                          # [B, Hk, S, D]
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] > k.shape[2])   # [B, H, 1, D]
    return o.squeeze(2)


# The ops write k_cache and v_cache without declaring it, as vLLM's attention op: the caches are views of one pool,
# and a declared mutation would make a tracing compiler copy the whole pool each step.
# Registered on a plain torch.library.Library (torch.library.custom_op's wrapper costs ~40 us a call, 30 a token).
# The CPU kernels are C++ (cpu_kernels.py, registered for the CPU key once loaded); the torch implementations below
# serve every other device, a machine where the C++ cannot be built, and the CPU until the kernels are loaded.
_LIB = torch.library.Library("kvscope", "DEF")
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, "
            "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor")
_LIB.define("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor")
_LIB.define("decode_layer(Tensor h, Tensor[] weights, Tensor? qkv_bias, Tensor input_norm, Tensor post_norm, "
            "float eps, Tensor cos_sin, Tensor positions, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, "
            "Tensor block_tables, Tensor seq_lens, int num_heads, float scale) -> Tensor")


def decode_attention_ref(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale):
    """The torch implementation of kvscope::decode_attention (and the C++ kernel's reference in the tests)."""
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, seq_lens.tolist(), scale)


_NO_SLOTS = torch.empty(0, dtype=torch.int64)


_LIB.impl("decode_attention", decode_attention_ref, "CompositeExplicitAutograd")   # C++ takes the CPU key once loaded
_LIB.impl("decode_attention", lambda q, *args: torch.empty_like(q), "Meta")


def int4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group: int) -> torch.Tensor:
    """The torch implementation of kvscope::int4_linear: x [M, K] @ w.T -> [M, N] in x's dtype, w dequantized from
    kvscope's int4 byte layout (qweight uint8 [N, K / 2]: byte i of a group holds k = i in its low nibble and
    k = group / 2 + i in its high one; w = q * scale + min per group) and the product in fp32. The C++ kernel
    rounds the activations to two int8 codes a value per 32-block (~16 bits); this reference does not."""
    N = qweight.shape[0]
    p = qweight.view(N, -1, group // 2)                                      # [N, groups, G / 2]
    codes = torch.cat((p & 15, p >> 4), dim=2).float()                       # [N, groups, G]
    w = (codes * scales.float()[..., None] + mins.float()[..., None]).view(N, -1)   # [N, K]
    return F.linear(x.float(), w).to(x.dtype)


_LIB.impl("int4_linear", int4_linear_ref, "CompositeExplicitAutograd")     # C++ takes the CPU key once loaded
_LIB.impl("int4_linear", lambda x, qweight, *args: x.new_empty((x.shape[0], qweight.shape[0])), "Meta")


def decode_layer_ref(h, weights, qkv_bias, input_norm, post_norm, eps, cos_sin, positions, k_cache, v_cache,
                     slot_mapping, block_tables, seq_lens, num_heads, scale):
    """The torch implementation of kvscope::decode_layer (and the C++ kernel's reference in the tests): one Llama
    decoder layer's decode step, h [B, hidden] float (the residual stream of B single-token sequences) -> the
    same after the layer. weights: (qweight, scales, mins) of qkv_proj, o_proj, gate_up_proj and down_proj in
    kvscope's int4 layout. The projections and the attention are the ops the eager layer calls (kvscope::int4_linear,
    kvscope::decode_attention: their C++ kernels where loaded), the rest the eager path's torch ops."""
    B = h.shape[0]
    Hk, D = k_cache.shape[2], k_cache.shape[3]

    def linear(x: torch.Tensor, i: int) -> torch.Tensor:
        qweight, scales, mins = weights[3 * i:3 * i + 3]
        return torch.ops.kvscope.int4_linear(x, qweight, scales, mins, x.shape[1] // scales.shape[1])

    qkv = linear(rms_norm(h, input_norm, eps)[0], 0)
    if qkv_bias is not None:
        qkv = qkv + qkv_bias
    q, k, v = qkv.split([num_heads * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(B, num_heads, D), k.view(B, Hk, D), v.view(B, Hk, D)
    apply_rope(q, k, positions, cos_sin)
    o = torch.ops.kvscope.decode_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale)
    h = linear(o.reshape(B, num_heads * D), 1) + h
    gu = linear(rms_norm(h, post_norm, eps)[0], 2)                            # [B, 2I]
    return linear(silu_and_mul(gu), 3) + h


_LIB.impl("decode_layer", decode_layer_ref, "CompositeExplicitAutograd")   # C++ takes the CPU key once loaded
_LIB.impl("decode_layer", lambda h, *args: torch.empty_like(h), "Meta")
