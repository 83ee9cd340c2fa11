"""asyncengine: a paged-KV LLM inference engine with continuous batching."""

from asyncengine.config import AsyncEngineArgs, EngineArgs, EngineConfig
from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.engine.llm import LLM
from asyncengine.engine.llm_engine import EngineStats, LLMEngine
from asyncengine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "CompletionOutput",
    "DuplicateRequestError",
    "EngineArgs",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
