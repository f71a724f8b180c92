from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
