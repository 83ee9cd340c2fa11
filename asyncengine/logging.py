"""structlog set-up, in one place: JSON lines when stderr is not a terminal, pretty when it is.

`asyncengine serve` logs at INFO; a program that uses the engine as a library (`LLM`,
`AsyncLLMEngine`) and has not called `configure_logging` logs warnings and errors only, unless
the environment sets ASYNCENGINE_LOG_LEVEL (as VLLM_LOGGING_LEVEL does for vLLM).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

LOG_LEVEL_ENV = "ASYNCENGINE_LOG_LEVEL"
LIBRARY_LOG_LEVEL = "WARNING"

_configured = False
_settings: tuple[str, bool] | None = None  # configure_logging's (level, json), once called


def configure_logging(level: str = "INFO", json: bool | None = None) -> None:
    """Route structlog (and stdlib logging) to stderr at `level`; JSON unless on a terminal."""
    global _configured, _settings
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"log level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
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
