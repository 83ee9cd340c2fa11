"""vLLM's module path for the engine arguments, so `from ...engine.arg_utils import EngineArgs`
ports with the package name changed. The classes live in `asyncengine.config`."""

from asyncengine.config import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
