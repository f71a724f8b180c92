"""kvscope's inference engine: a vLLM-like API over a paged-KV continuous-batching engine."""
from engine.config import EngineConfig
from engine.llm import LLM
from engine.runtime.llm_engine import EngineOverloaded, LLMEngine
from engine.outputs import Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics",
           "Logprob", "EngineOverloaded", "StructuredOutputsParams"]
