"""Why the server ended a request the engine was still running: the server core's own enum.

gRPC maps it to proto values (convert.py), metrics to its labels, the log line to its name.
"""

from __future__ import annotations

import enum


class AbortReason(enum.Enum):
    """Set once, by whoever aborts the request, before the engine sees the abort. A request
    aborted with none set was left by its caller (cancelled, disconnected, past its deadline)."""

    CANCELLED = enum.auto()  # Control.Abort named it
    TIME_LIMIT = enum.auto()  # its own time limit passed
    ABORTED_BY_SERVER = enum.auto()  # drain, shutdown, a second signal
