"""The failures a caller can act on, one type each (the gRPC layer maps each to one status)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad field, too long, can never fit): fix it, don't retry."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is still in flight."""


class EngineOverloadedError(RuntimeError):
    """Admission limits are reached: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine stopped (a fatal error in its step loop, or shutdown); `__cause__` says why."""
