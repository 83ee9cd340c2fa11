"""The operations flags of `asyncengine serve`: metrics port, connection age, log level."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine.server import app
from asyncengine.server.cli import build_parser
from asyncengine.server.options import (
    MiB,
    ServeOptions,
    check_options,
    serve_options_from,
)
from asyncengine.server.state import ServerState


def options(*flags: str) -> ServeOptions:
    ns = build_parser().parse_args(["serve", "--model", "m", *flags])
    return serve_options_from(ns)


def test_max_connection_age_becomes_the_grpc_server_argument() -> None:
    with_age = dict(app.grpc_options(options("--max-connection-age", "300"), MiB))
    assert with_age["grpc.max_connection_age_ms"] == 300_000
    assert "grpc.max_connection_age_ms" not in dict(app.grpc_options(options(), MiB))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--metrics-port", "70000"), "--metrics-port must be in"),
        (("--metrics-port", "9000", "--port", "9000"), "--metrics-port must differ"),
        (("--max-connection-age", "0"), "--max-connection-age must be > 0"),
    ],
)
def test_bad_operations_flags_are_refused_naming_the_flag(
    flags: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_options(options(*flags))


def test_log_level_is_accepted_before_and_after_the_subcommand() -> None:
    parser = build_parser()
    assert parser.parse_args(["--log-level", "DEBUG", "serve", "--model", "m"]).log_level == "DEBUG"
    assert parser.parse_args(["serve", "--model", "m", "--log-level", "ERROR"]).log_level == "ERROR"
    assert parser.parse_args(["serve", "--model", "m"]).log_level is None
    assert parser.parse_args(["generate", "--model", "m", "x", "--log-level", "INFO"]).log_level


def test_grpc_connection_and_backlog_limits_become_server_arguments() -> None:
    args = dict(app.grpc_options(options(), MiB))
    # gRPC-core's own backlog default (random cancels past 1000 calls) is replaced by one bound
    assert args["grpc.server.max_pending_requests"] == ServeOptions.max_pending_rpcs
    assert args["grpc.server.max_pending_requests_hard_limit"] == ServeOptions.max_pending_rpcs
    assert args["grpc.max_concurrent_streams"] == ServeOptions.max_concurrent_streams
    flags = ("--max-connection-idle", "45", "--handshake-timeout", "5")
    args = dict(app.grpc_options(options(*flags), MiB))
    assert args["grpc.max_connection_idle_ms"] == 45_000
    assert args["grpc.server_handshake_timeout_ms"] == 5_000


def test_the_served_name_defaults_to_the_model_directory_name(tmp_path: Path) -> None:
    model = tmp_path / "llama-3-8b"
    model.mkdir()
    assert options("--model", f"{model}/").served_model_name == "llama-3-8b"
    assert options("--model", "meta-llama/Llama-3.1-8B").served_model_name == (
        "meta-llama/Llama-3.1-8B"  # a hub id is a name already, as vLLM serves it
    )
    flags = ("--model", str(model), "--served-model-name", "mine")
    assert options(*flags).served_model_name == "mine"


class _Engine:
    """What ServerState reads of an engine to name the model and size messages."""

    def __init__(self, max_model_len: int, max_prompt_bytes: int) -> None:
        self.max_model_len = max_model_len
        scheduler_config = type("SchedulerConfig", (), {"max_prompt_bytes": max_prompt_bytes})
        model_config = type("ModelConfig", (), {"model": "tiny-llama"})
        self.config = type(
            "Config", (), {"scheduler_config": scheduler_config, "model_config": model_config}
        )


def _max_message_size(max_model_len: int, *flags: str) -> int:
    engine = _Engine(max_model_len, 32 * max_model_len)  # --max-prompt-bytes' default
    return ServerState(engine, options(*flags)).max_message_size  # type: ignore[arg-type]


def test_the_message_size_is_8_mib_unless_the_longest_prompt_needs_more() -> None:
    assert _max_message_size(2048) == 8 * MiB
    assert _max_message_size(131_072) == 8 * MiB  # a 4 MiB text prompt and 1 MiB more
    # a 1M context: a text prompt of 32 MiB (--max-prompt-bytes' default), and 1 MiB more
    assert _max_message_size(1 << 20) == 33 * MiB
    # token ids are the longest prompt when text is held short: 8 bytes each
    engine = _Engine(1 << 20, max_prompt_bytes=MiB)
    assert ServerState(engine, options()).max_message_size == 9 * MiB  # type: ignore[arg-type]


def test_an_explicit_message_size_wins_both_ways() -> None:
    assert _max_message_size(2048, "--max-message-size", str(64 * MiB)) == 64 * MiB
    assert _max_message_size(1 << 20, "--max-message-size", str(2 * MiB)) == 2 * MiB
    with pytest.raises(ValueError, match="--max-message-size must be >= 1"):
        check_options(options("--max-message-size", "0"))
