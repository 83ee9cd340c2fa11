"""The JSON log line a server writes per request: one object per line, structlog's ISO-8601 UTC
stamp, every value encoded (what JSON has no type for, as its repr)."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import structlog

from asyncengine import logging as ae_logging


@pytest.fixture
def json_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """configure_logging(json=True) writing to a buffer; structlog's set-up restored after."""
    saved = structlog.get_config()
    settings = ae_logging.logging_settings()
    buffer = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buffer)
    ae_logging.configure_logging("INFO", json=True)
    try:
        yield buffer
    finally:
        structlog.configure(**saved)
        monkeypatch.setattr(ae_logging, "_settings", settings)


def test_json_line_fields_and_stamp(json_lines: io.StringIO) -> None:
    before = datetime.now(UTC)
    structlog.get_logger("t").info(
        "request_finished",
        request_id="r-é",
        tenant=None,
        total_s=0.0456,
        error=ValueError("bad"),
        shape=(2, 3),
        by_pair={(1, 2): 3},  # json.dumps refused this key, and the line with it
    )
    structlog.get_logger("t").debug("not_written")
    after = datetime.now(UTC)
    lines = json_lines.getvalue().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["event"] == "request_finished" and line["level"] == "info"
    assert line["request_id"] == "r-é" and line["tenant"] is None and line["total_s"] == 0.0456
    assert line["error"] == "ValueError('bad')" and line["shape"] == [2, 3]
    assert line["by_pair"] == {"(1, 2)": 3}
    stamp = line["timestamp"]
    # structlog's TimeStamper(fmt="iso", utc=True): microseconds, "Z"
    assert len(stamp) == len("2026-12-07T05:01:43.215641Z") and stamp.endswith("Z")
    when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    assert before - timedelta(microseconds=1) <= when <= after


def test_stamps_across_seconds() -> None:
    """The date part is formatted once a second: a line a second (or a day) later has its own."""
    day = 86_400
    for now in (1_800_000_000.25, 1_800_000_000.75, 1_800_000_001.0, 1_800_000_000.5 + day):
        expected = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        assert ae_logging.iso_utc(now) == expected
