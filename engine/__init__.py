"""kvscope's inference engine: a vLLM-like API over a paged-KV continuous-batching engine."""
from .config import EngineConfig
from .llm import LLM
from .llm_engine import EngineOverloaded, LLMEngine
from .outputs import Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .structured.params import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics",
           "Logprob", "EngineOverloaded", "StructuredOutputsParams"]
