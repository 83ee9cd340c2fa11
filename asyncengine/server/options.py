"""The server's own options (the engine's are EngineArgs): their defaults and checks.

Their flags and help are serve_flags.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

MiB = 1 << 20


@dataclass(frozen=True)
class ServeOptions:
    """How `asyncengine serve` listens, admits, authenticates and shuts down."""

    host: str = "0.0.0.0"
    port: int = 50051
    served_model_name: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_tokens: tuple[str, ...] = ()
    control_auth_tokens: tuple[str, ...] = ()
    # scrapers and probes carry no app tokens (vLLM's /metrics is open with --api-key too):
    # the HTTP port's /metrics is open unless operators want it behind their Control token
    auth_metrics: bool = False
    max_message_size: int | None = None  # None: message_size_limit's rule
    max_queued_requests: int = 1024
    max_concurrent_rpcs: int | None = None
    retry_after: float = 1.0
    heartbeat_interval: float = 5.0
    stall_timeout: float = 60.0
    drain_grace_period: float = 30.0
    keepalive_time: float = 30.0
    keepalive_timeout: float = 10.0
    min_client_ping_interval: float = 10.0
    reflection: bool = True
    engine_process: bool = True
    # the engine process's heartbeat comes every second from a thread of its own, whatever the
    # steps do: 30 s of silence is a stopped, frozen or starved process, never a long step
    engine_heartbeat_timeout: float = 30.0
    torch_threads: int | None = None
    metrics_port: int | None = None
    metrics_host: str | None = None
    max_connection_age: float | None = None
    max_connection_idle: float = 600.0
    handshake_timeout: float = 20.0
    max_pending_rpcs: int = 16384
    max_concurrent_streams: int = 2048
    http_header_timeout: float = 10.0
    http_body_timeout: float = 60.0
    http_keep_alive_timeout: float = 30.0
    http_max_connections: int = 4096
    http_port: int | None = None
    http_host: str | None = None
    chat_template: str | None = None
    # vLLM's `--lora-modules name=path ...` (or JSON entries); parsed by server/lora.py
    lora_modules: tuple[str, ...] = field(
        default=(), metadata={"takes_list": True, "metavar": "NAME=PATH"}
    )
    allow_runtime_lora_updating: bool = False


# what a message may hold beside its prompt (options, stop strings, a schema) under the default
MESSAGE_HEADROOM_BYTES = 1 * MiB
# the default's floor (TGI's whole default is 2 MB): above gRPC's 4 MiB, and what a body this
# big still costs the loop (msgspec's split, grpc's copy into bytes: ~2 ms a MB) is ~20 ms
MIN_MESSAGE_SIZE = 8 * MiB
# bytes a token id of a prompt may take: a six-digit id and its ", " in JSON (a protobuf
# varint takes at most five)
PROMPT_ID_BYTES = 8


def message_size_limit(options: ServeOptions, max_model_len: int, max_prompt_bytes: int) -> int:
    """The bytes one gRPC message or HTTP body may have: --max-message-size when given, else
    8 MiB, or more when the engine's longest prompt (max_model_len token ids, or a text of
    max_prompt_bytes) needs more, with room for the other fields."""
    if options.max_message_size is not None:
        return options.max_message_size
    longest_prompt = max(PROMPT_ID_BYTES * max_model_len, max_prompt_bytes)
    return max(MIN_MESSAGE_SIZE, longest_prompt + MESSAGE_HEADROOM_BYTES)


def serve_options_from(ns: argparse.Namespace) -> ServeOptions:
    """ServeOptions from parsed flags (serve_flags.py) and the token environment variables.

    Without --served-model-name the name is the default of the --model value as given (a hub
    id stays itself; its download's directory is named by a commit hash).
    """
    envs = {"auth_tokens": "ASYNCENGINE_AUTH_TOKENS",
            "control_auth_tokens": "ASYNCENGINE_CONTROL_AUTH_TOKENS"}  # fmt: skip
    fields = [f.name for f in dataclasses.fields(ServeOptions)]
    values = {name: getattr(ns, name) for name in fields if name not in envs}
    for name, env_name in envs.items():  # repeated flags, named in the singular (--auth-token)
        values[name] = _tokens(getattr(ns, name.removesuffix("s")), env_name)
    values["lora_modules"] = tuple(values["lora_modules"] or ())
    if values["served_model_name"] is None and getattr(ns, "model", None):
        values["served_model_name"] = default_served_model_name(ns.model)
    return ServeOptions(**values)


def default_served_model_name(model: str) -> str:
    """The name a model is served under without --served-model-name: a local directory's own
    name (`/models/llama-3-8b/` -> `llama-3-8b`), as a hub id's last part names the model; any
    other value (a hub id, `org/name`) as given, as vLLM serves it."""
    if os.path.isdir(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model)))
    return model


def parse_auth_token(value: str) -> tuple[str | None, str]:
    """(group, token) of an --auth-token value: GROUP:TOKEN names a group, a bare TOKEN none."""
    group, has_group, token = value.partition(":")
    return (group, token) if has_group else (None, value)


def _tokens(flag_values: list[str] | None, env_name: str) -> tuple[str, ...]:
    from_env = [t.strip() for t in os.environ.get(env_name, "").split(",")]
    return tuple(t for t in [*(flag_values or []), *from_env] if t)


def check_options(options: ServeOptions) -> None:
    """Reject inconsistent options before anything starts (ValueError naming the flag)."""
    if bool(options.tls_cert) != bool(options.tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    if options.tls_client_ca and not options.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    for name in (
        "heartbeat_interval",
        "stall_timeout",
        "drain_grace_period",
        "keepalive_time",
        "max_connection_idle",
        "handshake_timeout",
        "http_header_timeout",
        "http_body_timeout",
        "http_keep_alive_timeout",
        "retry_after",
        "engine_heartbeat_timeout",
    ):
        if getattr(options, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for flag, path in [
        ("--tls-cert", options.tls_cert),
        ("--tls-key", options.tls_key),
        ("--tls-client-ca", options.tls_client_ca),
    ]:
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r} is not a readable file")
    groups: dict[str, str | None] = {}
    for value in options.auth_tokens:  # messages never quote a token: they get logged
        group, token = parse_auth_token(value)
        if group == "" or not token:
            raise ValueError("--auth-token GROUP:TOKEN needs a non-empty GROUP and TOKEN")
        if groups.setdefault(token, group) != group:
            raise ValueError("--auth-token: a token is given twice with different groups")
    if not groups.keys().isdisjoint(options.control_auth_tokens):
        raise ValueError("--control-auth-token must differ from every --auth-token")
    if options.auth_metrics and not options.control_auth_tokens:
        raise ValueError("--auth-metrics needs --control-auth-token (the token /metrics takes)")
    if options.max_message_size is not None and options.max_message_size < 1:
        raise ValueError("--max-message-size must be >= 1")
    for name in ("max_pending_rpcs", "max_concurrent_streams", "http_max_connections"):
        if getattr(options, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if options.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    if options.max_connection_age is not None and options.max_connection_age <= 0:
        raise ValueError("--max-connection-age must be > 0")
    if options.metrics_port is not None and not 0 <= options.metrics_port <= 65535:
        raise ValueError("--metrics-port must be in [0, 65535]")
    if options.metrics_port and options.metrics_port == options.port:
        raise ValueError("--metrics-port must differ from --port")
    if options.http_port is not None and not 0 <= options.http_port <= 65535:
        raise ValueError("--http-port must be in [0, 65535]")
    if options.http_port and options.http_port in (options.port, options.metrics_port):
        raise ValueError("--http-port must differ from --port and --metrics-port")
    if options.chat_template and not os.path.isfile(options.chat_template):
        raise ValueError(f"--chat-template {options.chat_template!r} is not a readable file")
