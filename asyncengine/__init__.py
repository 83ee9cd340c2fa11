"""asyncengine: a paged-KV LLM inference engine with continuous batching.

The engine's classes load on first use, so `import asyncengine.core` (the scheduler and the
block manager, pure Python) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncengine.config import AsyncEngineArgs, EngineArgs, EngineConfig
from asyncengine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from asyncengine.inputs import PromptType, TextPrompt, TokensPrompt
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from asyncengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncengine.engine.async_llm_engine import AsyncLLMEngine
    from asyncengine.engine.llm import LLM
    from asyncengine.engine.llm_engine import EngineStats, LLMEngine

# name -> the module that defines it (these need torch)
_LAZY = {
    "AsyncLLMEngine": "asyncengine.engine.async_llm_engine",
    "LLM": "asyncengine.engine.llm",
    "EngineStats": "asyncengine.engine.llm_engine",
    "LLMEngine": "asyncengine.engine.llm_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")


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
    "LoRARequest",
    "Logprob",
    "PromptType",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"
