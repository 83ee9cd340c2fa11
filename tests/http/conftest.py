"""Fixtures of the HTTP API's tests; the servers themselves are in serving_http.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from asyncengine import testing


@pytest.fixture(scope="session")
def chat_model(model_dir: Callable[..., Path]) -> Path:
    """The tests' tiny Llama with `asyncengine.testing.CHAT_TEMPLATE` as its chat template."""
    return model_dir("llama", chat_template=testing.CHAT_TEMPLATE)
