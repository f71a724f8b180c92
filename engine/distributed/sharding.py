"""Which slice of each weight a tensor-parallel rank holds (Megatron-style), for the loader and dummy weights.

Column-parallel (output rows split): q/k/v (by heads), gate/up (by intermediate rows), the embedding and the
LM head (by vocabulary rows). Row-parallel (input columns split): o_proj and down_proj, each followed by one
all-reduce. Norms are replicated.

Heads are split by KV-head groups, so every rank's query heads attend to its own KV heads: with at least as
many KV heads as ranks they are spread as evenly as possible (9 heads / 3 KV heads over 2 ranks: 6 + 3 query
heads, 2 + 1 KV heads); with fewer, each KV head is replicated on tensor_parallel_size / num_kv_heads ranks.
"""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

from engine.models.config import ModelArchConfig

VOCAB_UNIT = 64          # vocabulary shards are padded to a multiple of this many rows (as vLLM does)
ROW_UNIT = 64            # dummy weights are drawn per block of this many intermediate / vocabulary rows


@dataclass(frozen=True)
class ShardLayout:
    rank: int
    size: int
    q_start: int         # first query head of this rank
    num_heads: int       # query heads here
    kv_start: int        # first KV head here
    num_kv_heads: int
    i_start: int         # first intermediate row here
    intermediate: int
    v_start: int         # first vocabulary row here
    vocab: int           # vocabulary rows here (the last shard is padded with zero rows past vocab_size)


def shard_layout(cfg: ModelArchConfig, size: int, rank: int) -> ShardLayout:
    """The slice of the model that `rank` of `size` holds; a clear error where the model cannot be split."""
    H, Hk = cfg.num_heads, cfg.num_kv_heads
    if Hk >= size:
        kv_counts = [Hk // size + (r < Hk % size) for r in range(size)]
        kv_start, nkv = sum(kv_counts[:rank]), kv_counts[rank]
        g = H // Hk
        q_start, nq = kv_start * g, nkv * g
    else:
        if size % Hk or H % size:
            raise ValueError(f"EngineConfig.tensor_parallel_size: {size} ranks cannot share {Hk} KV heads "
                             f"(need tensor_parallel_size % num_kv_heads == 0 and num_heads ({H}) % "
                             "tensor_parallel_size == 0)")
        nq, nkv = H // size, 1
        q_start, kv_start = rank * nq, rank * Hk // size
    I = cfg.intermediate_size
    if I % size:
        raise ValueError(f"EngineConfig.tensor_parallel_size: intermediate_size {I} does not split over "
                         f"{size} ranks")
    il = I // size
    vl = -(-cfg.vocab_size // (size * VOCAB_UNIT)) * VOCAB_UNIT
    return ShardLayout(rank, size, q_start, nq, kv_start, nkv, rank * il, il, rank * vl, vl)


def local_config(cfg: ModelArchConfig, lay: ShardLayout) -> ModelArchConfig:
    """The ModelArchConfig of one rank's shard: the model classes build shard-sized layers from it."""
    return dataclasses.replace(cfg, num_heads=lay.num_heads, num_kv_heads=lay.num_kv_heads,
                               intermediate_size=lay.intermediate, vocab_size=lay.vocab)


def hf_slice(rest: str, cfg: ModelArchConfig, lay: ShardLayout) -> tuple[int, int, int] | None:
    """HF parameter name (after `model.layers.N.` for layer weights) -> (dim, start, length) of this rank's
    slice, or None for a replicated tensor."""
    d = cfg.head_dim
    if rest.startswith("self_attn.q_proj."):
        return 0, lay.q_start * d, lay.num_heads * d
    if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return 0, lay.kv_start * d, lay.num_kv_heads * d
    if rest == "self_attn.o_proj.weight":
        return 1, lay.q_start * d, lay.num_heads * d
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return 0, lay.i_start, lay.intermediate
    if rest == "mlp.down_proj.weight":
        return 1, lay.i_start, lay.intermediate
    if rest in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, lay.v_start, lay.vocab
    return None


def read_shard(sf, name: str, rest: str, cfg: ModelArchConfig, lay: ShardLayout | None) -> torch.Tensor:
    """Read only this rank's slice of `name` from an open safetensors file (zero rows past the vocabulary)."""
    if lay is None:
        return sf.get_tensor(name)
    sl = hf_slice(rest, cfg, lay)
    if sl is None:
        return sf.get_tensor(name)
    dim, start, n = sl
    view = sf.get_slice(name)
    full = view.get_shape()[dim]
    stop = min(start + n, full)
    t = view[start:stop] if dim == 0 else view[:, start:stop]
    if stop - start < n:                    # the padded tail of the last vocabulary shard
        pad = list(t.shape)
        pad[dim] = n - max(stop - start, 0)
        t = torch.cat([t, t.new_zeros(pad)], dim)
    return t


# ---- dummy weights -----------------------------------------------------------------------------------
def _units(rest: str, cfg: ModelArchConfig, lay: ShardLayout) -> tuple[int, int, int] | None:
    """-> (dim, unit, first unit) of this rank's slice in the full tensor, or None when replicated."""
    sl = hf_slice(rest, cfg, lay)
    if sl is None:
        return None
    dim, start, _ = sl
    unit = cfg.head_dim if rest.startswith("self_attn.") else ROW_UNIT
    if start % unit:
        raise ValueError(f"EngineConfig.tensor_parallel_size: dummy weights need {rest} shards to start at "
                         f"multiples of {unit} rows (got {start})")
    return dim, unit, start // unit


def _seed(seed: int, name: str, unit: int = 0) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + unit) % (1 << 62)


@torch.no_grad()
def fill_random(p: torch.Tensor, hf_name: str, rest: str, full: int, cfg: ModelArchConfig, lay: ShardLayout,
                seed: int) -> None:
    """Fill p (this rank's slice of HF tensor `hf_name`) with N(0, 0.02) drawn per block of rows or columns,
    each block from its own generator: every layout draws the same full tensor and a rank draws only its
    slice. full: the full tensor's size along the split dim (rows past it, vocabulary padding, stay zero)."""
    u = _units(rest, cfg, lay)
    if u is None:
        p.normal_(0.0, 0.02, generator=torch.Generator(device=p.device).manual_seed(_seed(seed, hf_name)))
        return
    dim, unit, first = u
    p.zero_()
    for j in range(-(-p.shape[dim] // unit)):
        n = min(unit, full - (first + j) * unit, p.shape[dim] - j * unit)
        if n <= 0:
            break
        gen = torch.Generator(device=p.device).manual_seed(_seed(seed, hf_name, 1 + first + j))
        block = p.narrow(dim, j * unit, n)              # drawn contiguous: a strided view draws in another order
        block.copy_(torch.empty(block.shape, dtype=p.dtype, device=p.device).normal_(0.0, 0.02, generator=gen))


def _hf_parts(name: str, cfg: ModelArchConfig, full: ModelArchConfig) -> list[tuple[str, str, int, int, int]]:
    """Our parameter -> [(HF name, HF name after the layer prefix, row offset, rows, full size along the
    split dim)]: q/k/v make qkv_proj and gate/up make gate_up_proj (models/llama.py)."""
    if not name.startswith("model.layers."):
        return [(name, name, 0, -1, full.vocab_size)]
    prefix, rest = ".".join(name.split(".")[:3]), name.split(".", 3)[3]
    d, kind = cfg.head_dim, rest.rsplit(".", 1)[1]
    if rest.startswith("self_attn.qkv_proj."):
        q, k = cfg.num_heads * d, cfg.num_kv_heads * d
        parts = [("q_proj", 0, q, full.num_heads * d), ("k_proj", q, k, full.num_kv_heads * d),
                 ("v_proj", q + k, k, full.num_kv_heads * d)]
        return [(f"{prefix}.self_attn.{n}.{kind}", f"self_attn.{n}.{kind}", o, r, f) for n, o, r, f in parts]
    if rest == "mlp.gate_up_proj.weight":
        i, fi = cfg.intermediate_size, full.intermediate_size
        return [(f"{prefix}.mlp.{n}.weight", f"mlp.{n}.weight", o, i, fi) for n, o in (("gate_proj", 0), ("up_proj", i))]
    f = {"self_attn.o_proj.weight": full.num_heads * d, "mlp.down_proj.weight": full.intermediate_size}.get(rest, 0)
    return [(name, rest, 0, -1, f)]


@torch.no_grad()
def init_dummy(model, full: ModelArchConfig, lay: ShardLayout, seed: int) -> None:
    """Deterministic random weights for one rank's shard: N(0, 0.02) for matrices and biases, ones for norms;
    the same full model for every tensor_parallel_size."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        for hf_name, rest, off, rows, size in _hf_parts(name, model.cfg, full):
            part = p if rows < 0 else p.narrow(0, off, rows)
            fill_random(part, hf_name, rest, size, full, lay, seed)
