"""structlog set-up, in one place: JSON lines when stderr is not a terminal, pretty when it is.

`asyncengine serve` logs at INFO; a program that uses the engine as a library (`LLM`,
`AsyncLLMEngine`) and has not called `configure_logging` logs warnings and errors only, unless
the environment sets ASYNCENGINE_LOG_LEVEL (as VLLM_LOGGING_LEVEL does for vLLM).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import msgspec
import structlog
from structlog.typing import EventDict

LOG_LEVEL_ENV = "ASYNCENGINE_LOG_LEVEL"
LIBRARY_LOG_LEVEL = "WARNING"

_configured = False
_settings: tuple[str, bool] | None = None  # configure_logging's (level, json), once called


def configure_logging(level: str = "INFO", json: bool | None = None) -> None:
    """Route structlog (and stdlib logging) to stderr at `level`; JSON unless on a terminal."""
    global _configured, _settings
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer(serializer=_json_line)
        if json
        else structlog.dev.ConsoleRenderer()
    )
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"log level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _stamp_utc,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(message)s")
    _configured = True
    _settings = (level, json)


# a server logs a line per request: structlog's own ISO stamper and renderer (json.dumps) were
# a third of its cost (10.6 us a line, 7.1 with these); these write the same stamp and JSON.
# What JSON has no type for (an exception, a key that is not a string) is written as its repr
_json_encoder = msgspec.json.Encoder(enc_hook=repr)
_formatted_second: tuple[int, str] = (-1, "")  # a second, and its date and time as ISO


def _stamp_utc(logger: Any, method_name: str, event_dict: EventDict) -> EventDict:
    event_dict["timestamp"] = iso_utc(time.time())
    return event_dict


def iso_utc(now: float) -> str:
    """`now` (seconds since the epoch) as structlog's TimeStamper(fmt="iso", utc=True) writes
    it, 2026-12-07T05:01:43.215641Z; the date and time are formatted once a second."""
    global _formatted_second
    second = int(now)
    formatted, prefix = _formatted_second  # one read: another thread may replace it
    if formatted != second:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _formatted_second = (second, prefix)
    return f"{prefix}.{int((now - second) * 1e6):06d}Z"


def _json_line(event_dict: dict[str, Any], **_: Any) -> str:
    return _json_encoder.encode(event_dict).decode()


def logging_settings() -> tuple[str, bool] | None:
    """How this process logs, for a child process to log the same way (None: not set up)."""
    return _settings


def default_log_level(default: str = LIBRARY_LOG_LEVEL) -> str:
    """ASYNCENGINE_LOG_LEVEL when set (checked), else `default`."""
    level = os.environ.get(LOG_LEVEL_ENV) or default
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"{LOG_LEVEL_ENV} must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    return level


def get_logger(name: str) -> Any:
    if not _configured:
        configure_logging(default_log_level())
    return structlog.get_logger(name)
