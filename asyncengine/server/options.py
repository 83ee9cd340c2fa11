"""The server's own options (the engine's are EngineArgs), each with why it has its default."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

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
    max_message_size: int = 64 * MiB
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


# flag -> (type, help); defaults come from ServeOptions so they are stated once
_FLAGS: dict[str, tuple[type, str]] = {
    "host": (str, "address to listen on"),
    "port": (int, "port to listen on (0 picks a free one; the log line 'serving' says which)"),
    "served_model_name": (str, "model name reported by GetModelInfo (default: the model path)"),
    "tls_cert": (str, "PEM server certificate: serve TLS instead of plaintext (needs --tls-key)"),
    "tls_key": (str, "PEM private key of --tls-cert"),
    "tls_client_ca": (
        str,
        "PEM CA bundle: require and verify client certificates (mutual TLS; needs --tls-cert)",
    ),
    "max_message_size": (
        int,
        "max bytes of one request or response message; well above gRPC's 4 MiB so long "
        "prompts as token ids and batched Generate calls fit",
    ),
    "max_queued_requests": (
        int,
        "requests admitted beyond a full running batch (--max-num-seqs); past that calls get "
        "RESOURCE_EXHAUSTED with a retry delay instead of an unbounded queue",
    ),
    "max_concurrent_rpcs": (
        int,
        "hard cap on concurrent RPCs of any kind, enforced by gRPC itself (RESOURCE_EXHAUSTED "
        "without details); a backstop behind the admission limit (default: no cap)",
    ),
    "retry_after": (float, "seconds suggested to clients (RetryInfo) when admission is refused"),
    "heartbeat_interval": (
        float,
        "seconds without a token before a stream gets a Heartbeat (queued, long prefill, "
        "preempted), so proxies with idle timeouts keep silent streams open",
    ),
    "stall_timeout": (
        float,
        "seconds a stream may go unread (the client stopped reading) before the server ends "
        "it with RESOURCE_EXHAUSTED (CLIENT_STALLED) and drops its buffered output",
    ),
    "drain_grace_period": (
        float,
        "seconds in-flight requests get to finish on SIGTERM/SIGINT or Drain before they are "
        "aborted (Finished ABORTED_BY_SERVER)",
    ),
    "keepalive_time": (
        float,
        "seconds between server keepalive pings: finds dead clients of long silent streams",
    ),
    "keepalive_timeout": (float, "seconds to wait for a keepalive ping's ack before closing"),
    "min_client_ping_interval": (
        float,
        "shortest interval of client pings the server accepts (without ping strikes), so "
        "clients keeping long generations alive are never cut off for 'too many pings'",
    ),
    "metrics_port": (
        int,
        "port of the Prometheus /metrics HTTP endpoint, separate from gRPC (0 picks a free one; "
        "the log line 'metrics_serving' says which; default: no endpoint)",
    ),
    "metrics_host": (str, "address of the metrics endpoint (default: --host)"),
    "max_connection_age": (
        float,
        "seconds after which a client connection is asked to close (HTTP/2 GOAWAY; calls in "
        "flight finish): clients then reconnect and re-resolve DNS, so balancing clients find "
        "replicas added by scale-out (default: never)",
    ),
    "max_connection_idle": (
        float,
        "seconds a gRPC connection may carry no call before the server closes it (HTTP/2 "
        "GOAWAY; the client reconnects on its next call): peers that connect and fall silent "
        "give their descriptors back",
    ),
    "handshake_timeout": (
        float,
        "seconds a new gRPC connection gets to finish its HTTP/2 (and TLS) handshake before "
        "it is closed: a socket that connects and sends nothing holds nothing for long",
    ),
    "max_pending_rpcs": (
        int,
        "gRPC calls received but not yet taken by the server's loop (a burst, a flood of "
        "cancelled calls); past it gRPC itself ends new calls CANCELLED. Far above the "
        "admission limit, so a burst meets admission (RESOURCE_EXHAUSTED with a retry delay) "
        "instead; gRPC's own default (random refusals from 1000) cancelled bursts",
    ),
    "max_concurrent_streams": (
        int,
        "calls one gRPC connection may have open at once (HTTP/2 SETTINGS); a client's "
        "further calls wait on its side, so one connection (a flood of opened and cancelled "
        "calls) cannot fill the server's queue; above the admission limit, so a gateway on "
        "one connection still sees RESOURCE_EXHAUSTED",
    ),
    "http_header_timeout": (
        float,
        "seconds an HTTP request may take to send its request line and headers (from its "
        "first byte, or from connecting) before the connection is closed: slowloris sockets",
    ),
    "http_body_timeout": (
        float,
        "seconds an HTTP request may take to send its whole body once its headers are in; "
        "past it the connection is closed (its handler sees a disconnect)",
    ),
    "http_keep_alive_timeout": (
        float,
        "seconds an idle HTTP keep-alive connection stays open between requests",
    ),
    "http_max_connections": (
        int,
        "HTTP connections open at once; past it new connections are closed at once, so "
        "idle sockets cannot exhaust the process's descriptors",
    ),
    "http_port": (
        int,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, ...), served beside gRPC over the same engine, "
        "admission limits, tokens and drain (0 picks a free one; the log line 'http_serving' "
        "says which; default: no HTTP API)",
    ),
    "http_host": (str, "address of the HTTP API (default: --host)"),
    "chat_template": (
        str,
        "file holding a Jinja chat template for /v1/chat/completions, in place of the "
        "tokenizer's own (default: the tokenizer's; a model with none answers chat with 400)",
    ),
    "engine_heartbeat_timeout": (
        float,
        "seconds the engine process (--engine-process) may send nothing, not even its "
        "heartbeat, before it is killed and declared dead: health NOT_SERVING, every stream "
        "ended, exit 1. Its heartbeat does not wait for steps, so a long prefill never trips "
        "it",
    ),
    "torch_threads": (
        int,
        "torch intra-op threads (default: torch's choice); 1 is fastest for tiny models on "
        "busy CPUs",
    ),
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeOptions field (auth tokens may repeat)."""
    defaults = ServeOptions()
    for name, (kind, text) in _FLAGS.items():
        default = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=default,
            help=text if "default" in text else text + " (default: %(default)s)",
        )
    parser.add_argument(
        "--auth-token",
        action="append",
        default=None,
        help="bearer token of a tenant, accepted by Generation (and reflection); each token is a "
        "tenant of its own whose prompts share no prefix-cache blocks with other tenants'. "
        "GROUP:TOKEN (split at the first ':') accepts TOKEN and makes every token of GROUP one "
        "tenant that shares its cache (repeat for several; also ASYNCENGINE_AUTH_TOKENS, "
        "comma-separated, so tokens stay out of `ps`; default: no auth)",
    )
    parser.add_argument(
        "--control-auth-token",
        action="append",
        default=None,
        help="bearer token the Control service (Abort, Drain, Resume, ...) requires; tenant "
        "tokens work there for Abort only, which reaches the tenant's own requests (a Control "
        "token's reaches every tenant's). With --auth-token and no --control-auth-token, "
        "Control but Abort is off: those calls get PERMISSION_DENIED (repeat for several; also "
        "ASYNCENGINE_CONTROL_AUTH_TOKENS; default: none)",
    )
    parser.add_argument(
        "--auth-metrics",
        action=argparse.BooleanOptionalAction,
        default=defaults.auth_metrics,
        help="the HTTP port's /metrics requires a --control-auth-token (Bearer), for an HTTP "
        "port that tenants reach; /health and /version stay open for probes, and "
        "--metrics-port's endpoint is never authenticated (default: %(default)s, open as "
        "Prometheus scrapers expect)",
    )
    parser.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=defaults.reflection,
        help="serve gRPC server reflection, for grpcurl and gateways (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=defaults.engine_process,
        help="step the engine in a process of its own, so scheduling and the servers' writes "
        "run on two cores; --no-engine-process keeps it on the server's event loop "
        "(default: %(default)s)",
    )


def serve_options_from(ns: argparse.Namespace) -> ServeOptions:
    """ServeOptions from parsed flags (and the token environment variables)."""
    values = {name: getattr(ns, name) for name in _FLAGS}
    return ServeOptions(
        **values,
        auth_tokens=_tokens(ns.auth_token, "ASYNCENGINE_AUTH_TOKENS"),
        control_auth_tokens=_tokens(ns.control_auth_token, "ASYNCENGINE_CONTROL_AUTH_TOKENS"),
        auth_metrics=ns.auth_metrics,
        reflection=ns.reflection,
        engine_process=ns.engine_process,
    )


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
