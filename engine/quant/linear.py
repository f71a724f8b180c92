"""QuantLinear: a linear layer over a quantized weight, and the model-wide swap from nn.Linear.

The kernels it runs (by EngineConfig.kernels): triton -> the fused dequantizing GEMV for decode steps
(kernels/quant_gemv.py) and the dequantizing GEMM above that (kernels/quant_gemm.py); torch (the CPU path)
-> dequantize, then F.linear. Only the decoder layers' projections are quantized; embeddings, norms and
lm_head stay in the model dtype, as in the published FP8 / w8a8 checkpoints.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels
from engine.quant import formats

# the projections a decoder layer quantizes (module paths inside model.model.layers[i])
QUANTIZED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class QuantLinear(nn.Module):
    def __init__(self, fmt: str, in_features: int, out_features: int, bias: torch.Tensor | None, device,
                 tensors: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.kernels = "torch"           # "triton": the Triton kernels (set by quantize_model / prepare_model)
        self.act_fp8 = False             # fp8 GEMM: activations quantized per token-group, FP8 tensor cores
        self.fp8_gemm = "triton"         # which FP8 GEMM: "triton" or "cublas" (resolved by set_fp8_gemm)
        self.tensor_cores = False        # fused GEMVs: kernels/quant_gemv_tc.py (EngineConfig.quant_gemv_tensor_cores)
        self.packed = False              # fused GEMVs: kernels/quant_gemv_packed.py (EngineConfig.quant_gemv_packed)
        self.group_dots = False          # int4 words GEMM: 8 dots a group (EngineConfig.quant_gemm_group_dots)
        self.cpu_int4 = 0                # the CPU int4 path's group (0: off): kvscope::int4_linear or torch's int4 GEMM
        self.cpu_int4_pack: tuple[torch.Tensor, torch.Tensor, int] | None = None   # torch's: (packed, scale_zeros, G)
        tensors = tensors if tensors is not None else formats.empty(fmt, out_features, in_features, device)
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t, requires_grad=False))
        self.bias = bias

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters(recurse=False) if n != "bias"}

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight this layer stands for (the reference its kernels are tested against)."""
        return formats.dequantize(self.fmt, self.tensors(), self.shape, dtype)

    def forward(self, x) -> torch.Tensor:
        """x [T, K] -> [T, N]."""
        if self.cpu_int4:
            return self._cpu_int4_mm(x)
        if self.kernels != "triton":
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        if self.act_fp8 and x.shape[0] > 0:
            from engine.kernels.quant_gemm_fp8 import fp8_matmul
            return fp8_matmul(x, self.tensors(), self.bias, self.fp8_gemm)
        from engine.kernels.quant_gemm import quant_matmul
        return quant_matmul(x, self.fmt, self.tensors(), self.shape, self.bias, group_dots=self.group_dots)

    def _cpu_int4_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N]: kvscope::int4_linear (the C++ kernel, activations as two int8 codes per 32-block) on
        the layer's own tensors where the C++ kernels are loaded, else torch's CPU int4 GEMM (bf16 activations and
        scales; its fp32 variant is not vectorized). K must be the weight's (no group padding)."""
        if self.cpu_int4_pack is None or cpu_kernels.loaded():
            y = torch.ops.kvscope.int4_linear(x, self.qweight, self.scales, self.mins, self.cpu_int4)
        else:
            packed, sz, G = self.cpu_int4_pack
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, G, sz).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def fused(self, x: torch.Tensor, *, prologue: str | None = None, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6, residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
        """ops.fused_linear's contract (kernels/gemv.py) over this layer's weight and bias."""
        if self.kernels != "triton":
            from engine.kernels import torch_ops
            return torch_ops.fused_linear(x, self.dequantize(x.dtype), self.bias, prologue=prologue,
                                          norm_weight=norm_weight, eps=eps, residual=residual)
        if self.packed and x.shape[0] <= 16 and not self.tensor_cores:
            from engine.kernels.quant_gemv_packed import quant_fused_linear_packed
            return quant_fused_linear_packed(x, self.fmt, self.tensors(), self.shape, self.bias, prologue=prologue,
                                             norm_weight=norm_weight, eps=eps, residual=residual, pdl=pdl)
        from engine.kernels.quant_gemv import quant_fused_linear
        return quant_fused_linear(x, self.fmt, self.tensors(), self.shape, self.bias, prologue=prologue,
                                  norm_weight=norm_weight, eps=eps, residual=residual, pdl=pdl,
                                  tensor_cores=self.tensor_cores and x.shape[0] <= 16)

    def fused_qkv_rope_store(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, num_heads: int,
                             num_kv_heads: int, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """ops.fused_qkv_rope_store's contract (kernels/qkv_rope.py) over this layer's weight and bias."""
        args = (norm_weight, eps, num_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping)
        if self.kernels != "triton":
            from engine.kernels import torch_ops
            return torch_ops.fused_qkv_rope_store(x, self.dequantize(x.dtype), self.bias, *args)
        from engine.kernels.quant_qkv_rope import quant_fused_qkv_rope_store
        head_dim = self.out_features // (num_heads + 2 * num_kv_heads)
        M = x.shape[0]
        if self.packed and self.fmt == "int4" and 1 < M <= 16 and not self.tensor_cores:
            # int4 words at M > 1: the packed GEMV with the rows on the grid (each program the M = 1 dot), then the
            # RoPE + KV-store kernel. The RoPE kernel's packed dot keeps M rows in one program (BLOCK_M > 1): the
            # shared-row int4 dot that rows_on_grid_default keeps out of the packed GEMV.
            from engine.kernels.quant_packed_configs import rows_on_grid_default
            if rows_on_grid_default(self.fmt):
                from engine.kernels.rope import rope_and_store
                D = head_dim
                qkv = self.fused(x, prologue="rms_norm", norm_weight=norm_weight, eps=eps, pdl=pdl)
                q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
                q, k, v = q.view(M, num_heads, D), k.view(M, num_kv_heads, D), v.view(M, num_kv_heads, D)
                rope_and_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, pdl=pdl)
                return q
        # the packed dot under RoPE (no split-K, 16 rows a program) only for int4, whose words nothing else reads:
        # with it fp8's 8B decode step measured 3.12 ms against 3.09 on the earlier q/k/v kernel
        tc = self.tensor_cores and x.shape[0] <= 16 and head_dim % 32 == 0
        return quant_fused_qkv_rope_store(x, self.fmt, self.tensors(), self.shape, self.bias, *args, pdl=pdl,
                                          tensor_cores=tc, packed=self.packed and self.fmt == "int4" and M <= 16)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


def fused_linear(ops, layer: nn.Module, x: torch.Tensor, **fusions) -> torch.Tensor:
    """ops.fused_linear over a plain or a quantized linear layer."""
    if isinstance(layer, QuantLinear):
        fusions.pop("variant", None)                        # the bf16 GEMV's launch variant
        return layer.fused(x, **fusions)
    return ops.fused_linear(x, layer.weight, layer.bias, **fusions)


def qkv_rope_fusable(layer: nn.Module, head_dim: int) -> bool:
    """Whether the q/k/v projection can take RoPE and the KV store in its epilogue (ops.fused_qkv_rope_store or
    QuantLinear.fused_qkv_rope_store)."""
    if isinstance(layer, QuantLinear):
        from engine.kernels.quant_qkv_rope import qkv_rope_supported
        return qkv_rope_supported(layer.fmt, head_dim)
    return isinstance(layer, nn.Linear)


def fused_qkv_rope_store(ops, layer: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """ops.fused_qkv_rope_store over a plain or a quantized q/k/v projection (see qkv_rope_fusable)."""
    if isinstance(layer, QuantLinear):
        return layer.fused_qkv_rope_store(x, *args, **kwargs)
    return ops.fused_qkv_rope_store(x, layer.weight, layer.bias, *args, **kwargs)


def _layer_linears(model):
    for layer in model.model.layers:
        for path in QUANTIZED:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            yield parent, attr, getattr(parent, attr)


CPU_INT4_ROWS = 16          # torch's CPU int4 packing takes output rows in multiples of 16


def cpu_int4_supported(lin) -> bool:
    return isinstance(lin, QuantLinear) and lin.fmt == "int4" and lin.qweight.device.type == "cpu" and \
        lin.qweight.dtype == torch.uint8 and lin.in_features % formats.int4_group(lin.tensors()) == 0 and \
        lin.out_features % CPU_INT4_ROWS == 0


@torch.no_grad()
def set_cpu_int4(lin: QuantLinear, torch_gemm: bool | None = None) -> None:
    """Put an int4 layer on the CPU int4 path: kvscope::int4_linear reads the layer's own tensors (nothing to
    pack); torch's CPU int4 GEMM, the path until the C++ kernels are loaded, needs its own copy (torch_gemm;
    None: only where the C++ kernels are not loaded now): codes [N, K] -> its packed layout, and (scale, zero)
    [K / G, N, 2] bf16 with w = (q - 8) * scale + zero, i.e. zero = min + 8 * scale."""
    lin.cpu_int4 = formats.int4_group(lin.tensors())
    if torch_gemm is None:
        torch_gemm = not cpu_kernels.loaded()
    if not torch_gemm:
        lin.cpu_int4_pack = None
        return
    t, G = lin.tensors(), lin.cpu_int4
    codes = formats.int4_codes(t).to(torch.int32)                                   # [N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    scale, mn = t["scales"].float(), t["mins"].float()                              # [N, K / G]
    sz = torch.stack((scale, mn + 8 * scale), dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
    lin.cpu_int4_pack = (packed, sz, G)


class RescoredLMHead(nn.Module):
    """An int4 LM head on the CPU int4 path (QuantLinear.cpu_int4) whose top candidates are rescored against the float weight: the
    logits that decide greedy decoding (and the head of a sampled distribution) are the float head's, the tail's
    the int4 head's. The int4 head alone changed fp32's greedy tokens on 5 of 6 held-out chat prompts of the
    bundled model (mean per-token KL 0.044); rescored, 6 of 6 stay identical (benchmarks/check_cpu_quant.py)."""

    def __init__(self, q: QuantLinear, weight: torch.Tensor, top: int = 8, chunk: int = 64):
        super().__init__()
        self.q, self.top, self.chunk = q, top, chunk
        self.weight = weight                                # [V, K] float; a tied embedding's own table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, V]. The candidates, the int4 head's top `top` of a row, lie in the `top` chunks of
        `chunk` logits with the largest maxima: a chunk max and two small top-k's instead of a top-k over the
        vocabulary (~5x slower on the CPU)."""
        logits = self.q(x)                                                          # [T, V]
        T, V = logits.shape
        C, k = self.chunk, min(self.top, V)
        if V <= k * C:
            idx = logits.topk(k, -1).indices                                         # [T, k] token ids
        else:
            padded = F.pad(logits, (0, -V % C), value=float("-inf"))
            chunks = padded.view(T, -1, C).amax(-1).topk(k, -1).indices             # [T, k]
            cand = (chunks[..., None] * C + torch.arange(C, device=x.device)).view(T, -1)  # [T, k * C]
            idx = cand.gather(1, padded.gather(1, cand).topk(k, -1).indices)        # [T, k] token ids
        rows = self.weight.index_select(0, idx.view(-1)).view(T, k, -1)             # [T, k, K]
        exact = torch.bmm(rows, x.to(rows.dtype)[:, :, None])[..., 0]              # [T, k]
        return logits.scatter_(1, idx, exact.to(logits.dtype))


def _quantize_lm_head_cpu(model, group: int) -> None:
    """int4 LM head on the CPU int4 GEMM, its top candidates rescored (RescoredLMHead): the LM head is a fifth of
    a small model's weights, the largest single read of a CPU decode step, and its float weight stays for the
    rescoring (a tied embedding keeps it for the lookups anyway)."""
    head = model.lm_head
    if not isinstance(head, nn.Linear) or head.weight.device.type != "cpu" or head.in_features % group or \
            head.out_features % CPU_INT4_ROWS:
        return
    q = QuantLinear("int4", head.in_features, head.out_features, None, head.weight.device,
                    formats.quantize(head.weight, "int4", group))
    set_cpu_int4(q)
    model.lm_head = RescoredLMHead(q, head.weight)


def _set_kernels(model, kernels: str, act_fp8: bool) -> None:
    for _, _, lin in _layer_linears(model):
        lin.kernels = kernels
        lin.act_fp8 = act_fp8 and lin.fmt == "fp8"


def set_tensor_cores(model, on: bool | None) -> None:
    """The quantized layers' fused GEMVs on tensor cores (kernels/quant_gemv_tc.py) or CUDA cores. None: per
    shape, tensor cores where benchmarks/sweep_quant_gemv.py found them faster (QUANT_GEMV_TC_CONFIGS)."""
    from engine.kernels.quant_gemv_tc import QUANT_GEMV_TC_CONFIGS
    for _, _, lin in _layer_linears(model):
        if isinstance(lin, QuantLinear):
            lin.tensor_cores = on if on is not None else (lin.fmt, *lin.shape) in QUANT_GEMV_TC_CONFIGS
            if lin.fmt == "int4" and lin.qweight.dtype == torch.int32:
                lin.tensor_cores = False                    # the words layout: the packed GEMV's


def set_fp8_gemm(model, mode: str) -> None:
    """The FP8 GEMM of the fp8 layers whose activations are quantized ("auto" | "triton" | "cublas"): auto ->
    cublas where torch has cuBLAS's block-wise scaled_mm for the shape, else triton."""
    from engine.kernels.quant_gemm_fp8 import cublas_supported
    for _, _, lin in _layer_linears(model):
        if not (isinstance(lin, QuantLinear) and lin.act_fp8):
            continue
        ok = cublas_supported(*lin.shape)
        if mode == "cublas" and not ok:
            raise ValueError(f"fp8_gemm: 'cublas' needs torch's block-wise scaled_mm (sm90, CUDA >= "
                             f"12.9, N and K multiples of 128, K / 128 a multiple of 4); this is torch "
                             f"{torch.__version__} (CUDA {torch.version.cuda}), weight {tuple(lin.shape)}")
        lin.fp8_gemm = ("cublas" if ok else "triton") if mode == "auto" else mode


@torch.no_grad()
def set_packed(model, on: bool, group_dots: bool) -> None:
    """The packed-word decode GEMV (kernels/quant_gemv_packed.py) for the quantized layers: int4 repacked to the
    words layout (and back when off) and always on it; int8 too (K % 4 == 0); fp8 where QUANT_GEMV_PACKED_CONFIGS
    lists the shape. A layer set_tensor_cores puts on tensor cores stays there. group_dots: the int4 words GEMM's
    8 dots a group. Call before set_tensor_cores."""
    from engine.kernels.quant_packed_configs import QUANT_GEMV_PACKED_CONFIGS, packed_supported
    for _, _, lin in _layer_linears(model):
        if not isinstance(lin, QuantLinear):
            continue
        if lin.fmt == "int4":
            words = lin.qweight.dtype == torch.int32
            if on and not words:
                lin.qweight = nn.Parameter(formats.int4_to_words(lin.tensors())["qweight"], requires_grad=False)
            elif not on and words:
                codes = formats.int4_codes(lin.tensors())
                G = formats.int4_group(lin.tensors())
                c = codes.view(codes.shape[0], -1, 2, G // 2)
                lin.qweight = nn.Parameter((c[:, :, 0] | (c[:, :, 1] << 4)).view(codes.shape[0], -1).contiguous(),
                                           requires_grad=False)
            lin.packed = on
        else:
            lin.packed = on and packed_supported(lin.fmt, lin.in_features) and \
                (lin.fmt == "int8" or (lin.fmt, *lin.shape) in QUANT_GEMV_PACKED_CONFIGS)
        lin.group_dots = lin.packed and group_dots


ROW_PARALLEL = ("o_proj", "down_proj")     # tensor parallelism splits their input columns


@torch.no_grad()
def quantize_model(model, fmt: str, kernels: str, act_fp8: bool = False, group: int = formats.BLOCK,
                   tp=None) -> None:
    """Quantize the decoder projections in place, one at a time (the float weight is freed as each goes).
    group: the int4 group size. tp (a TensorParallel of size > 1): each rank quantizes its shard; fp8 blocks
    and int4 groups are those of the whole weight where shards start on their boundaries, and int8's per-row
    scale of a row-parallel shard is the whole row's (|max| reduced over the ranks)."""
    for parent, attr, lin in _layer_linears(model):
        if isinstance(lin, QuantLinear):
            continue
        absmax = None
        if fmt == "int8" and tp is not None and tp.size > 1 and attr in ROW_PARALLEL:
            absmax = tp.all_max(lin.weight.detach().float().abs().amax(dim=1, keepdim=True))
        q = QuantLinear(fmt, lin.in_features, lin.out_features, lin.bias, lin.weight.device,
                        formats.quantize(lin.weight, fmt, group, absmax))
        setattr(parent, attr, q)
        del lin
    _set_kernels(model, kernels, act_fp8)
    if kernels == "torch" and fmt == "int4":
        if next(model.parameters()).device.type == "cpu":
            cpu_kernels.prepare()           # loaded where built: no copy for torch's int4 GEMM (set_cpu_int4)
        for _, _, lin in _layer_linears(model):
            if cpu_int4_supported(lin):
                set_cpu_int4(lin)
        if tp is None or tp.size == 1:
            _quantize_lm_head_cpu(model, group)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()          # the freed float weights go back to the driver: sizing sees them


def prepare_model(model, fmt: str, kernels: str, act_fp8: bool = False) -> None:
    """Swap the decoder projections for empty QuantLinears that a pre-quantized checkpoint fills."""
    for parent, attr, lin in _layer_linears(model):
        setattr(parent, attr, QuantLinear(fmt, lin.in_features, lin.out_features, lin.bias, lin.weight.device))
    _set_kernels(model, kernels, act_fp8)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()


def weight_bytes(model) -> dict:
    """The model's parameter bytes: by dtype, and per decoder layer by dtype (tied weights counted once)."""
    seen: set[int] = set()

    def tally(module, out: dict) -> None:
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = str(p.dtype).replace("torch.", "")
            out[key] = out.get(key, 0) + p.numel() * p.element_size()

    per_layer = []
    for layer in model.model.layers:
        d: dict = {}
        tally(layer, d)
        per_layer.append(d)
    other: dict = {}
    tally(model, other)                    # what is left: embeddings, final norm, lm_head (if untied)
    total: dict = dict(other)
    for d in per_layer:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return {"by_dtype": total, "per_layer": per_layer, "other": other, "total": sum(total.values())}
