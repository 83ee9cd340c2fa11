"""Python client of the asyncengine gRPC API (asyncengine.v1): `AsyncClient` and `Client`."""

from asyncengine_client.aio import AsyncClient
from asyncengine_client.errors import (
    AsyncEngineError,
    AuthError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    UnavailableError,
)
from asyncengine_client.options import GenerateOptions, RetryPolicy, Tls
from asyncengine_client.results import (
    Accepted,
    Completion,
    Delta,
    Finished,
    FinishReason,
    Heartbeat,
    LoadReport,
    LoRAAdapter,
    ModelInfo,
    ServerInfo,
    StreamEvent,
    TokenizeResult,
    TokenLogprob,
    TokenLogprobs,
    Usage,
)
from asyncengine_client.sync import Client

__version__ = "0.1.0"

__all__ = [
    "Accepted",
    "AsyncClient",
    "AsyncEngineError",
    "AuthError",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "Delta",
    "FinishReason",
    "Finished",
    "GenerateOptions",
    "Heartbeat",
    "InvalidRequestError",
    "LoRAAdapter",
    "LoadReport",
    "ModelInfo",
    "OverloadedError",
    "RetryPolicy",
    "ServerInfo",
    "StreamEvent",
    "Tls",
    "TokenLogprob",
    "TokenLogprobs",
    "TokenizeResult",
    "UnavailableError",
    "Usage",
]
