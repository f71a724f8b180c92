from .config import ModelConfig
from .llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
