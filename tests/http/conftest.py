"""Fixtures of the HTTP API's tests; the servers themselves are in serving_http.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serving_http import CORES, ServerThread, http_server

from asyncengine import testing


@pytest.fixture(scope="session", params=list(CORES))
def core(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The `serve` flags of one core client; every server fixture takes it, so the tests that
    use a server run against both (the session runs them over one core, then the other)."""
    return CORES[request.param]


@pytest.fixture(scope="session")
def chat_model(model_dir: Callable[..., Path]) -> Path:
    """The tests' tiny Llama with `asyncengine.testing.CHAT_TEMPLATE` as its chat template."""
    return model_dir("llama", chat_template=testing.CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def server(chat_model: Path, core: tuple[str, ...]) -> Iterator[ServerThread]:
    """The chat model served (its forwards run) over one core, shared by the modules that
    call it as any client would; nothing may be left running or held at the end."""
    with http_server(chat_model, *core) as served:
        yield served
        served.assert_nothing_left()
