"""ModelArchConfig: the architecture facts the engine needs, read from a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelArchConfig:
    arch: str                        # "llama" | "qwen2" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False     # q/k/v bias (Qwen2)
    qk_norm: bool = False            # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    sliding_window: int | None = None  # keys older than this many positions are masked (Mistral, Qwen2 with
    #                                    use_sliding_window); the engine keeps sequences within it
    hf_config: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArchConfig":
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = SUPPORTED_ARCHS.get(archs[0])
        if arch is None:
            raise ValueError(f"model: architecture {archs[0]!r} is not supported "
                             f"(supported: {sorted(SUPPORTED_ARCHS)})")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if layer_types is not None:        # transformers 5: which layers slide
            window = window if "sliding_attention" in layer_types else None
        elif arch != "llama" and not cfg.get("use_sliding_window", False):
            window = None                  # Qwen configs carry a window they use only when told to
        return cls(
            arch=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=int(window) if window else None,
            hf_config=cfg,
        )
