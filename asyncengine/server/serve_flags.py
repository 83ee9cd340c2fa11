"""`asyncengine serve`'s own flags (the engine's are engine_flags.py), in `--help`'s groups.

Types and defaults are ServeOptions' (options.py); here is what each flag does and why it
has its default.
"""

from __future__ import annotations

import argparse

from asyncengine.server.flags import FlagGroup, add_flag_groups
from asyncengine.server.options import ServeOptions

SERVER = FlagGroup(
    "server (gRPC)",
    "Where the gRPC API (Generation, Control, health, reflection) listens, and its connections.",
    {
        "host": "address to listen on",
        "port": "port to listen on (0 picks a free one; the log line 'serving' says which)",
        "served_model_name": "the model's name: what /v1/models, GetModelInfo and the metrics "
        "report and what requests give as `model` (default: the --model directory's name, "
        "`llama-3-8b` for /models/llama-3-8b, or a hub id as given; requests naming the --model "
        "path are accepted too)",
        "reflection": "serve gRPC server reflection, for grpcurl and gateways",
        "max_message_size": "max bytes of one gRPC message (either way) or HTTP body; past it "
        "RESOURCE_EXHAUSTED or 413. What a body of this size costs the serving loop before it "
        "is refused or parsed off it (~2 ms a MB) bounds every stream's stall (default: "
        "the longest prompt the engine takes plus 1 MiB, at least 8 MiB; that prompt is "
        "max_model_len token ids at 8 bytes each or --max-prompt-bytes of text, whichever is "
        "longer: 8 MiB up to a 224k context with --max-prompt-bytes' default; the log line "
        "'serving' says which)",
        "max_concurrent_rpcs": "hard cap on concurrent RPCs of any kind, enforced by gRPC itself "
        "(RESOURCE_EXHAUSTED without details); a backstop behind the admission limit (default: "
        "no cap)",
        "keepalive_time": "seconds between server keepalive pings: finds dead clients of long "
        "silent streams",
        "keepalive_timeout": "seconds to wait for a keepalive ping's ack before closing",
        "min_client_ping_interval": "shortest interval of client pings the server accepts "
        "(without ping strikes), so clients keeping long generations alive are never cut off "
        "for 'too many pings'",
        "max_connection_age": "seconds after which a client connection is asked to close "
        "(HTTP/2 GOAWAY; calls in flight finish): clients then reconnect and re-resolve DNS, so "
        "balancing clients find replicas added by scale-out (default: never)",
        "max_connection_idle": "seconds a gRPC connection may carry no call before the server "
        "closes it (HTTP/2 GOAWAY; the client reconnects on its next call): peers that connect "
        "and fall silent give their descriptors back",
        "handshake_timeout": "seconds a new gRPC connection gets to finish its HTTP/2 (and TLS) "
        "handshake before it is closed: a socket that connects and sends nothing holds nothing "
        "for long",
        "max_pending_rpcs": "gRPC calls received but not yet taken by the server's loop (a "
        "burst, a flood of cancelled calls); past it gRPC itself ends new calls CANCELLED. Far "
        "above the admission limit, so a burst meets admission (RESOURCE_EXHAUSTED with a retry "
        "delay) instead; gRPC's own default (random refusals from 1000) cancelled bursts",
        "max_concurrent_streams": "calls one gRPC connection may have open at once (HTTP/2 "
        "SETTINGS); a client's further calls wait on its side, so one connection (a flood of "
        "opened and cancelled calls) cannot fill the server's queue; above the admission limit, "
        "so a gateway on one connection still sees RESOURCE_EXHAUSTED",
    },
)
HTTP = FlagGroup(
    "OpenAI HTTP API",
    "Off unless --http-port is given: /v1/completions, /v1/chat/completions, /v1/models and "
    "vLLM's extra routes, beside gRPC over the same engine, limits, tokens and drain.",
    {
        "http_port": "port of the OpenAI-compatible HTTP API (0 picks a free one; the log line "
        "'http_serving' says which; default: no HTTP API)",
        "http_host": "address of the HTTP API (default: --host)",
        "chat_template": "file holding a Jinja chat template for /v1/chat/completions, in place "
        "of the tokenizer's own (default: the tokenizer's; a model with none answers chat with "
        "400)",
        "http_header_timeout": "seconds an HTTP request may take to send its request line and "
        "headers (from its first byte, or from connecting) before the connection is closed: "
        "slowloris sockets",
        "http_body_timeout": "seconds an HTTP request may take to send its whole body once its "
        "headers are in; past it the connection is closed (its handler sees a disconnect)",
        "http_keep_alive_timeout": "seconds an idle HTTP keep-alive connection stays open "
        "between requests",
        "http_max_connections": "HTTP connections open at once; past it new connections are "
        "closed at once, so idle sockets cannot exhaust the process's descriptors",
    },
)
LORA = FlagGroup(
    "LoRA adapters",
    "Which adapters the server serves by name (requests give it as OpenAI's `model` or gRPC's "
    "lora_name); both need --enable-lora.",
    {
        "lora_modules": "adapters to load at start-up, each name=path (a PEFT directory: "
        "adapter_config.json and adapter_model.safetensors) or vLLM's JSON form "
        '{"name": ..., "path": ..., "base_model_name": ...}; ids 1, 2, ... in the order given; '
        "the server does not start if one cannot be loaded (default: none)",
        "allow_runtime_lora_updating": "allow loading and unloading adapters while serving: "
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (routes absent without it, as "
        "vLLM's without VLLM_ALLOW_RUNTIME_LORA_UPDATING) and Control.LoadLoRA / UnloadLoRA "
        "(FAILED_PRECONDITION without it), all behind the Control token; only for operators "
        "who trust the paths their Control token holders name (default: %(default)s)",
    },
)
ADMISSION = FlagGroup(
    "admission, streams and drain",
    "How many requests are taken, how silent or unread streams are handled, and how a "
    "shutdown ends them; both protocols alike.",
    {
        "max_queued_requests": "requests admitted beyond a full running batch (--max-num-seqs); "
        "past that calls get RESOURCE_EXHAUSTED (HTTP 429) with a retry delay instead of an "
        "unbounded queue",
        "retry_after": "seconds suggested to clients (gRPC RetryInfo, HTTP Retry-After) when "
        "admission is refused",
        "heartbeat_interval": "seconds without a token before a stream gets a Heartbeat (gRPC) "
        "or an SSE comment (HTTP): queued, long prefill, preempted; so proxies with idle "
        "timeouts keep silent streams open",
        "stall_timeout": "seconds a stream may go unread (the client stopped reading) before the "
        "server ends it (gRPC: RESOURCE_EXHAUSTED, CLIENT_STALLED) and drops its buffered "
        "output",
        "drain_grace_period": "seconds in-flight requests get to finish on SIGTERM/SIGINT or "
        "Drain before they are aborted (Finished ABORTED_BY_SERVER)",
    },
)
SECURITY = FlagGroup(
    "security",
    "TLS and bearer tokens; without them the server is plaintext and open to anyone who can "
    "reach its ports.",
    {
        "tls_cert": "PEM server certificate: serve TLS instead of plaintext, on gRPC and HTTP "
        "(needs --tls-key; default: plaintext)",
        "tls_key": "PEM private key of --tls-cert (default: none)",
        "tls_client_ca": "PEM CA bundle: require and verify client certificates (mutual TLS; "
        "needs --tls-cert; default: no client certificates)",
        "auth_tokens": "bearer token of a tenant, accepted by Generation, the HTTP API (and "
        "reflection); each token is a tenant of its own whose prompts share no prefix-cache "
        "blocks with other tenants'. GROUP:TOKEN (split at the first ':') accepts TOKEN and "
        "makes every token of GROUP one tenant that shares its cache (repeat for several; also "
        "ASYNCENGINE_AUTH_TOKENS, comma-separated, so tokens stay out of `ps`; default: no "
        "auth)",
        "control_auth_tokens": "bearer token the Control service (Abort, Drain, Resume, ...) "
        "requires; tenant tokens work there for Abort only, which reaches the tenant's own "
        "requests (a Control token's reaches every tenant's). With --auth-token and no "
        "--control-auth-token, Control but Abort is off: those calls get PERMISSION_DENIED "
        "(repeat for several; also ASYNCENGINE_CONTROL_AUTH_TOKENS; default: none)",
        "auth_metrics": "the HTTP port's /metrics requires a --control-auth-token (Bearer), for "
        "an HTTP port that tenants reach; /health and /version stay open for probes, and "
        "--metrics-port's endpoint is never authenticated (default: %(default)s, open as "
        "Prometheus scrapers expect)",
    },
)
OBSERVABILITY = FlagGroup(
    "observability",
    "Prometheus metrics and logs (JSON lines on stderr, one per finished request at INFO).",
    {
        "metrics_port": "port of a Prometheus /metrics HTTP endpoint of its own, apart from "
        "gRPC and the HTTP API (whose /metrics serves the same registry; 0 picks a free one; "
        "the log line 'metrics_serving' says which; default: no endpoint)",
        "metrics_host": "address of the metrics endpoint (default: --host)",
    },
)
ENGINE_PROCESS = FlagGroup(
    "engine process",
    "Where the engine steps and how its death is noticed.",
    {
        "engine_process": "step the engine in a process of its own, so scheduling and the "
        "servers' writes run on two cores; --no-engine-process keeps it on the server's event "
        "loop",
        "engine_heartbeat_timeout": "seconds the engine process (--engine-process) may send "
        "nothing, not even its heartbeat, before it is killed and declared dead: health "
        "NOT_SERVING, every stream ended, exit 1. Its heartbeat does not wait for steps, so a "
        "long prefill never trips it",
        "torch_threads": "torch intra-op threads (default: torch's choice); 1 is fastest for "
        "tiny models on busy CPUs",
    },
)
SERVE_GROUPS = [SERVER, HTTP, LORA, ADMISSION, SECURITY, OBSERVABILITY, ENGINE_PROCESS]


def add_serve_args(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One flag per ServeOptions field, in SERVE_GROUPS; returns the groups by title."""
    return add_flag_groups(parser, ServeOptions, SERVE_GROUPS, ServeOptions())
