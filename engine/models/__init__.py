from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM

__all__ = ["ModelArchConfig", "LlamaForCausalLM"]
