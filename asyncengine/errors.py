"""The failures a caller can act on, one type each (each front end maps each to one status)."""

from __future__ import annotations

MAX_DESCRIPTION_LEN = 1000


class InvalidRequestError(ValueError):
    """The request itself is wrong (bad field, too long, can never fit): fix it, don't retry.

    `field` names the engine's field (`prompt`, `request_id`, `stop_token_ids`, ...); front
    ends translate it to their own names through a table, never by parsing the message.
    """

    def __init__(self, field: str, description: str) -> None:
        # bounded: an error travels in a status's metadata, which clients cap at 16 KiB
        description = description[:MAX_DESCRIPTION_LEN]
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class ContextLengthError(InvalidRequestError):
    """The prompt, with the output it asks for, does not fit the model's context length."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is still in flight."""

    def __init__(self, request_id: str) -> None:
        shown = request_id if len(request_id) <= 64 else request_id[:61] + "..."
        super().__init__("request_id", f"{shown!r} is already in flight")


class EngineOverloadedError(RuntimeError):
    """Admission limits are reached: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (a bug, logged with its cause); the engine and
    every other request go on. Not retryable as is."""


class EngineDeadError(RuntimeError):
    """The engine stopped (a fatal error in its step loop, or shutdown); `__cause__` says why.

    The message is the same for every stream: it never carries another request's values.
    """


class EngineProcessLostError(RuntimeError):
    """The engine process exited or fell silent: a cause of engine death that holds no
    request's values, so callers may read it (EngineDeadError's message quotes it)."""


class KVCacheSizingError(RuntimeError):
    """At start-up: the memory budget cannot hold the KV cache the settings need; the message
    says which setting to change (the CLI prints it as one line)."""


_MAX_NAME_SHOWN = 128  # characters of a caller's adapter name an error repeats


class LoRANotFoundError(LookupError):
    """A request or a call names an adapter (by name or id) that is not registered."""

    def __init__(self, name_or_id: str | int) -> None:
        shown = name_or_id
        if isinstance(shown, str) and len(shown) > _MAX_NAME_SHOWN:
            # a caller's name is echoed in the error's status: a long one outgrew the
            # client's metadata limit (16 KiB), which then saw no status at all
            shown = shown[:_MAX_NAME_SHOWN] + "..."
        super().__init__(f"LoRA adapter {shown!r} is not loaded")
        self.name_or_id = name_or_id


class LoRAInUseError(RuntimeError):
    """An adapter cannot be removed while requests run with it: retry once they finish."""

    def __init__(self, lora_int_id: int, num_requests: int) -> None:
        super().__init__(
            f"LoRA adapter {lora_int_id} is in use by {num_requests} request(s); "
            "remove it once they finish"
        )
        self.lora_int_id = lora_int_id
        self.num_requests = num_requests
