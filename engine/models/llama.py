"""A Llama-family decoder over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Parameters use Hugging Face names except for two fusions: q/k/v -> `qkv_proj` (rows q, k, v) and
gate/up -> `gate_up_proj` (rows gate, up); the loader concatenates them.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.kernels import cpu_kernels
from engine.kernels.metadata import AttentionMetadata
from engine.quant.linear import QuantLinear, fused_linear, fused_qkv_rope_store, qkv_rope_fusable
from engine.worker.timing import NullTimer
from engine.models.config import ModelArchConfig


def rope_cos_sin(cfg: ModelArchConfig, max_pos: int) -> torch.Tensor:
    """[max_pos, head_dim] float32: cos | sin of position * inv_freq (HF's default and llama3 rope)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "llama3":
        factor = sc["factor"]
        lo, hi = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > lo_wl, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= hi_wl) & (wavelen <= lo_wl)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"model: rope_scaling type {kind!r} is not supported (default, llama3)")
    pos = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)                      # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)    # [max_pos, D]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops):
        super().__init__()
        self.ops = ops
        self.h, self.hk, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.d ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hk) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        self.fused_qk_norm = True
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_cache = self.v_cache = torch.empty(0)          # [num_blocks, block_size, Hk, D], set by the runner

    def forward(self, x: torch.Tensor, md: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        return self.o_proj(self.attend(self.qkv_proj(x), md, cos_sin).reshape(T, self.h * self.d))

    def forward_small_batch(self, h: torch.Tensor, norm: RMSNorm, md: AttentionMetadata, cos_sin: torch.Tensor,
                            pdl: bool) -> torch.Tensor:
        """h [T, hidden] residual stream -> attention output [T, H * D]: RMSNorm, q/k/v, RoPE and the KV store
        in one fused linear (two kernels with q/k norm), then attention."""
        # the head norm sits between projection and RoPE
        if self.qk_norm or not qkv_rope_fusable(self.qkv_proj, self.d):
            qkv = fused_linear(self.ops, self.qkv_proj, h, prologue="rms_norm", norm_weight=norm.weight,
                               eps=norm.eps, pdl=pdl)
            return self.attend(qkv, md, cos_sin, pdl).reshape(h.shape[0], self.h * self.d)
        q = fused_qkv_rope_store(self.ops, self.qkv_proj, h, norm.weight, norm.eps, self.h, self.hk, md.positions,
                                 cos_sin, self.k_cache, self.v_cache, md.slot_mapping, pdl=pdl)      # [T, H, D]
        o = self.ops.paged_attention(q, self.k_cache, self.v_cache, md, self.scale, pdl=pdl)
        return o.reshape(h.shape[0], self.h * self.d)

    def attend(self, qkv: torch.Tensor, md: AttentionMetadata, cos_sin: torch.Tensor,
               pdl: bool = False) -> torch.Tensor:
        """qkv [T, (H + 2Hk) * D] -> attention output [T, H, D] (RoPE, KV stored into the paged cache).
        pdl: the kernels launch as programmatic dependents (see kernels/gemv.py)."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.h * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q = q.view(T, self.h, self.d)                          # [T, H, D]
        k = k.view(T, self.hk, self.d)                         # [T, Hk, D]
        v = v.view(T, self.hk, self.d)
        if self.qk_norm and self.fused_qk_norm:                 # in place on the qkv views
            self.ops.head_rms_norm_(q, self.q_norm.weight, self.q_norm.eps)
            self.ops.head_rms_norm_(k, self.k_norm.weight, self.k_norm.eps)
        elif self.qk_norm:                                      # copies of the views, one row a program
            q = self.ops.rms_norm(q.reshape(-1, self.d), self.q_norm.weight, self.q_norm.eps)[0]
            k = self.ops.rms_norm(k.reshape(-1, self.d), self.k_norm.weight, self.k_norm.eps)[0]
            q, k = q.view(T, self.h, self.d), k.view(T, self.hk, self.d)
        self.ops.rope_and_store(q, k, v, md.positions, cos_sin, self.k_cache, self.v_cache, md.slot_mapping,
                                pdl=pdl)
        return self.ops.paged_attention(q, self.k_cache, self.v_cache, md, self.scale, pdl=pdl)  # [T, H, D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gu = self.gate_up_proj(x)                                           # [T, 2I]
        return self.down_proj(self.ops.silu_and_mul(gu))                    # [T, I] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(cfg, ops)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, ops, max_pos: int, tp: TensorParallel = SINGLE):
        """With tensor parallelism cfg is this rank's shard (engine/distributed/sharding.py): its heads, its
        intermediate rows, its vocabulary rows; o_proj / down_proj outputs are partial sums until all-reduced."""
        super().__init__()
        self.cfg, self.ops, self.tp = cfg, ops, tp
        self.vocab_size = cfg.vocab_size   # of the whole model (the loader sets it for a shard)
        self.vocab_start = 0               # first vocabulary row of this rank's embedding / LM head
        self.model = LlamaModel(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("cos_sin", rope_cos_sin(cfg, max_pos), persistent=False)
        self.timer = NullTimer()
        self.gemv_max_tokens = 0           # steps of at most this many tokens take forward_small_batch
        self.gemv_pdl = False              # its linears launch as programmatic dependents (Hopper)
        self.gemv_variant = "auto"         # their launch (EngineConfig.gemv_variant)
        self.cpu_decode_layer = False      # CPU decode steps run kvscope::decode_layer a layer (EngineConfig)
        self._decode_layer_plan: list | None = None     # decode_layer_plan(), read once
        self.decode_layer_steps = 0        # forwards run through kvscope::decode_layer

    def set_kernel_options(self, config) -> None:
        """EngineConfig.gemv_variant (a Triton launch option; the torch ops ignore it) and fused_qk_norm."""
        self.gemv_variant = config.kernel_config.gemv_variant
        for layer in self.model.layers:
            layer.self_attn.fused_qk_norm = config.kernel_config.fused_qk_norm


    def forward(self, input_ids: torch.Tensor, md: AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden]. num_layers < all: the first layers only (self-drafting)."""
        if input_ids.shape[0] <= self.gemv_max_tokens:
            return self.forward_small_batch(input_ids, md, num_layers)
        if self.cpu_decode_layer and md.max_seqlen_q == 1 and cpu_kernels.loaded() \
                and input_ids.shape[0] == md.num_seqs and self.decode_layer_plan():
            return self.forward_decode_layers(input_ids, md, num_layers)
        t, ops, m = self.timer, self.ops, self.model
        with t.region("embedding"):
            x = self.embed(input_ids)                          # [T, hidden]
        x = self.all_reduce(x)
        residual = None
        norm = ops.rms_norm
        for layer in m.layers[:num_layers]:
            with t.region("norms"):
                x, residual = norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, residual)
            with t.region("attention"):
                x = layer.self_attn(x, md, self.cos_sin)
            x = self.all_reduce(x)
            with t.region("norms"):
                x, residual = norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                                   residual)
            with t.region("mlp"):
                x = layer.mlp(x)
            x = self.all_reduce(x)
        with t.region("norms"):
            x, _ = ops.rms_norm(x, m.norm.weight, m.norm.eps, residual)
        return x

    def forward_small_batch(self, input_ids: torch.Tensor, md: AttentionMetadata,
                            num_layers: int | None = None) -> torch.Tensor:
        """forward() for a few tokens (a decode step): norms, SiLU-mul, residual adds, RoPE and the KV store
        ride inside the fused linears, so a layer is 4 linears + attention. h is the residual stream; with tensor
        parallelism rank 0 alone adds it before the all-reduce of the partial sums."""
        t, ops, m, pdl, var = self.timer, self.ops, self.model, self.gemv_pdl, self.gemv_variant
        first = self.tp.rank == 0
        with t.region("embedding"):
            h = self.embed(input_ids)                          # [T, hidden]
        h = self.all_reduce(h)
        for layer in m.layers[:num_layers]:
            a, mlp, ln1, ln2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            with t.region("attention"):
                o = a.forward_small_batch(h, ln1, md, self.cos_sin, pdl)    # [T, H * D]
                h = fused_linear(ops, a.o_proj, o, residual=h if first else None, pdl=pdl, variant=var)
            h = self.all_reduce(h)
            with t.region("mlp"):
                gu = fused_linear(ops, mlp.gate_up_proj, h, prologue="rms_norm", norm_weight=ln2.weight,
                                  eps=ln2.eps, pdl=pdl, variant=var)
                h = fused_linear(ops, mlp.down_proj, gu, prologue="silu_mul", residual=h if first else None, pdl=pdl,
                                 variant=var)
            h = self.all_reduce(h)
        with t.region("norms"):
            x, _ = ops.rms_norm(h, m.norm.weight, m.norm.eps)
        return x

    def decode_layer_plan(self) -> list[tuple]:
        """Per layer, what kvscope::decode_layer takes of it: (attention module, [qweight, scales, mins of qkv_proj,
        o_proj, gate_up_proj, down_proj], q/k/v bias, input norm weight, post-attention norm weight, eps); [] where
        the model does not fit the op (an fp32 model with every projection on the CPU int4 path, no q/k norm, no
        bias but q/k/v's, one rank). Read once: the tensors are the layers' own."""
        if self._decode_layer_plan is None:
            self._decode_layer_plan = []
            plan = []
            for layer in self.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                lins = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
                ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
                fits = (self.tp.size == 1 and self.model.embed_tokens.weight.dtype == torch.float32
                        and not a.qk_norm and ln1.eps == ln2.eps
                        and ln1.weight.dtype == ln2.weight.dtype == torch.float32
                        and all(isinstance(lin, QuantLinear) and lin.cpu_int4 and lin.qweight.dtype == torch.uint8
                                for lin in lins)
                        and all(lin.bias is None for lin in lins[1:])
                        and (lins[0].bias is None or lins[0].bias.dtype == torch.float32))
                if not fits:
                    return []
                weights = [t for lin in lins for t in (lin.qweight, lin.scales, lin.mins)]
                plan.append((a, weights, lins[0].bias, ln1.weight, ln2.weight, ln1.eps))
            self._decode_layer_plan = plan
        return self._decode_layer_plan

    def forward_decode_layers(self, input_ids: torch.Tensor, md: AttentionMetadata,
                              num_layers: int | None = None) -> torch.Tensor:
        """forward() for a decode-only CPU step (one token a sequence): each decoder layer is one C++ call,
        kvscope::decode_layer, on h, the residual stream [B, hidden]."""
        t, m = self.timer, self.model
        with t.region("embedding"):
            h = self.embed(input_ids)                          # [B, hidden]
        layer_op = torch.ops.kvscope.decode_layer.default
        cos_sin, pos, slots, tables, lens = self.cos_sin, md.positions, md.slot_mapping, md.block_tables, md.seq_lens
        self.decode_layer_steps += 1
        with t.region("layers"):
            for a, weights, bias, w1, w2, eps in self._decode_layer_plan[:num_layers]:
                h = layer_op(h, weights, bias, w1, w2, eps, cos_sin, pos, a.k_cache, a.v_cache, slots, tables, lens,
                             a.h, a.scale)
        with t.region("norms"):
            x, _ = self.ops.rms_norm(h, m.norm.weight, m.norm.eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [L, hidden] -> float32 logits [L, vocab]."""
        with self.timer.region("lm_head"):
            logits = self.lm_head(hidden)                      # [L, vocab rows of this rank]
        if self.tp.size > 1:
            with self.timer.region("all_gather"):
                logits = self.tp.all_gather_cols(logits)[:, :self.vocab_size]
        return logits.float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; a vocabulary shard gives zero rows for ids it does not hold."""
        e = self.model.embed_tokens
        if self.tp.size == 1:
            return e(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= e.num_embeddings)
        return e(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0.0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results (tensor parallelism); the identity on one rank."""
        if self.tp.size == 1:
            return x
        with self.timer.region("all_reduce"):
            return self.tp.all_reduce(x)
