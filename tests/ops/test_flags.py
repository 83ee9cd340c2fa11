"""The operations flags of `asyncengine serve`: metrics port, connection age, log level."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine.server import app
from asyncengine.server.cli import build_parser
from asyncengine.server.options import ServeOptions, check_options, serve_options_from


def options(*flags: str) -> ServeOptions:
    ns = build_parser().parse_args(["serve", "--model", "m", *flags])
    return serve_options_from(ns)


def test_max_connection_age_becomes_the_grpc_server_argument() -> None:
    with_age = dict(app.grpc_options(options("--max-connection-age", "300")))
    assert with_age["grpc.max_connection_age_ms"] == 300_000
    assert "grpc.max_connection_age_ms" not in dict(app.grpc_options(options()))


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
    args = dict(app.grpc_options(options()))
    # gRPC-core's own backlog default (random cancels past 1000 calls) is replaced by one bound
    assert args["grpc.server.max_pending_requests"] == ServeOptions.max_pending_rpcs
    assert args["grpc.server.max_pending_requests_hard_limit"] == ServeOptions.max_pending_rpcs
    assert args["grpc.max_concurrent_streams"] == ServeOptions.max_concurrent_streams
    flags = ("--max-connection-idle", "45", "--handshake-timeout", "5")
    args = dict(app.grpc_options(options(*flags)))
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
