"""Random-weight models with real shapes (vLLM's dummy load format), by preset name: `dummy:<name>`."""
from __future__ import annotations

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, max_position_embeddings=131072,
                         tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072,
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-70b": dict(architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                          rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072,
                          tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151645),
    "qwen2-0.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                       vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=151643,
                       eos_token_id=151645),
    # a tiny model for fast tests (SmolLM2's vocabulary, so its tokenizer fits)
    "tiny": dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                 vocab_size=49152, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"model: unknown preset {name!r} (known: {sorted(PRESETS)})")
    return dict(PRESETS[name])
