"""What both clients share: generation options, retry policy, TLS, channel setup, requests."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import random
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import wrappers_pb2

from asyncengine_client.errors import AsyncEngineError, InvalidRequestError, error_from_rpc
from asyncengine_client.v1 import generation_pb2 as pb

DEFAULT_TARGET = "localhost:50051"
# grpc's own balancer: one subchannel per address, picked in turn; a replica whose
# grpc.health.v1 status (service "") is not SERVING, e.g. while draining, drops out.
BALANCED_SERVICE_CONFIG = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
)


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """Sampling, stopping and response options; the keywords of `generate` / `generate_stream`.

    None means the server's default (temperature 1.0, no max_new_tokens limit short of the
    context, ...); temperature 0 is greedy.
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_new_tokens: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_string: bool = False
    time_limit_ms: int = 0
    return_token_ids: bool = False
    logprobs: int | None = None
    echo_prompt: bool = False
    skip_special_tokens: bool | None = None
    priority: int = 0
    # prefix-cache isolation: requests share cached prompt K/V only with the same salt
    cache_salt: str = ""
    # the LoRA adapter to generate with (its name on the server); "" is the base model
    lora_name: str = ""

    def __post_init__(self) -> None:
        """Each integer within its protobuf field's range, or InvalidRequestError naming the
        option (protobuf's own ValueError names none); top_k -1 is vLLM's "no top-k" (0)."""
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for name, bits in _UNSIGNED_BITS.items():
            value = getattr(self, name)
            values = value if name == "stop_token_ids" else () if value is None else (value,)
            if not all(isinstance(v, int) and 0 <= v < 1 << bits for v in values):
                raise _out_of_range(name, f"[0, 2**{bits})", value)
        if not -(1 << 31) <= self.priority < 1 << 31:
            raise _out_of_range("priority", "[-2**31, 2**31)", self.priority)

    def sampling(self) -> pb.SamplingOptions:
        return pb.SamplingOptions(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            n=self.n,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )

    def stopping(self) -> pb.StoppingOptions:
        return pb.StoppingOptions(
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            include_stop_string=self.include_stop_string,
            time_limit_ms=self.time_limit_ms,
        )

    def response(self) -> pb.ResponseOptions:
        return pb.ResponseOptions(
            return_token_ids=self.return_token_ids,
            logprobs=self.logprobs,
            echo_prompt=self.echo_prompt,
            skip_special_tokens=self.skip_special_tokens,
        )


# the integer options and the width of their unsigned protobuf fields
_UNSIGNED_BITS = {
    "max_new_tokens": 32, "min_new_tokens": 32, "top_k": 32, "seed": 64, "n": 32,
    "time_limit_ms": 32, "logprobs": 32, "stop_token_ids": 32,
}  # fmt: skip


def _out_of_range(name: str, bounds: str, value: object) -> AsyncEngineError:
    return InvalidRequestError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{name} must be in {bounds}, got {value!r}"[:200],
        field=name,
    )


def stream_request(
    prompt: str | Sequence[int], options: GenerateOptions, request_id: str = ""
) -> pb.GenerateRequest:
    """The GenerateStream request for a text or token-id prompt."""
    request = pb.GenerateRequest(
        request_id=request_id,
        priority=options.priority,
        cache_salt=options.cache_salt,
        lora_name=options.lora_name,
        sampling=options.sampling(),
        stopping=options.stopping(),
        response=options.response(),
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def batch_request(
    prompts: Sequence[str | Sequence[int]], options: GenerateOptions
) -> pb.GenerateBatchRequest:
    """The unary Generate request: many prompts, one parameter set."""
    if isinstance(prompts, str):
        raise TypeError("generate() takes a list of prompts; use [prompt] for one")
    return pb.GenerateBatchRequest(
        prompts=[
            pb.Prompt(text=p) if isinstance(p, str) else pb.Prompt(token_ids=pb.TokenIds(ids=p))
            for p in prompts
        ],
        priority=options.priority,
        cache_salt=options.cache_salt,
        lora_name=options.lora_name,
        sampling=options.sampling(),
        stopping=options.stopping(),
        response=options.response(),
    )


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Retries of UNAVAILABLE, and of RESOURCE_EXHAUSTED when the server says when (RetryInfo).

    Without a server delay the wait is random in [0, backoff), the backoff growing by
    `multiplier` per attempt up to `max_backoff_s` (gRPC's retry design). A stream is retried
    only before its first message, so tokens are never duplicated.
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0

    def delay_s(self, error: AsyncEngineError, attempt: int) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up."""
        if attempt >= self.max_attempts:
            return None
        if error.retry_delay_s is not None and error.code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ):
            return error.retry_delay_s
        # RESOURCE_EXHAUSTED without RetryInfo can be a message over the size limit: not retried
        if error.code == grpc.StatusCode.UNAVAILABLE:
            backoff = self.initial_backoff_s * self.multiplier ** (attempt - 1)
            return random.uniform(0, min(backoff, self.max_backoff_s))
        return None


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS settings: PEM bytes. No root cert: the system roots. Cert + key: mTLS."""

    root_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    # the name checked against the server certificate, when it is not the target's host
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> Tls:
        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return cls(read(ca), read(cert), read(key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("mTLS needs both client_cert and client_key")
        return grpc.ssl_channel_credentials(self.root_cert, self.client_key, self.client_cert)


@dataclasses.dataclass(frozen=True)
class ChannelConfig:
    """Target, credentials (None: plaintext) and options for grpc's sync or aio channel."""

    target: str
    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, str | int]]


def channel_config(
    target: str | Sequence[str],
    *,
    tls: Tls | grpc.ChannelCredentials | None,
    round_robin: bool | None,
    options: Sequence[tuple[str, str | int]],
) -> ChannelConfig:
    """Several addresses (or `round_robin=True` with e.g. `dns:///name:port`) get grpc's
    round_robin policy with health checking; one address is plain pick_first."""
    if not isinstance(target, str):
        addresses = list(target)
        target = addresses[0] if len(addresses) == 1 else balanced_target(addresses)
        round_robin = len(addresses) > 1 if round_robin is None else round_robin
    channel_options = list(options)
    if round_robin:
        channel_options.append(("grpc.service_config", BALANCED_SERVICE_CONFIG))
    if isinstance(tls, Tls):
        if tls.server_name:
            channel_options.append(("grpc.ssl_target_name_override", tls.server_name))
        tls = tls.credentials()
    return ChannelConfig(target, tls, channel_options)


def balanced_target(addresses: Sequence[str]) -> str:
    """One `ipv4:` / `ipv6:` target naming every `host:port`, for grpc's round_robin.

    Host names are resolved once, here (to IPv4); for membership that changes, pass one
    `dns:///name:port` target whose name lists every replica, with `round_robin=True`.
    """
    resolved = []
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"expected host:port, got {address!r}")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            info = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
            ip = ipaddress.ip_address(info[0][4][0])
        resolved.append((ip, port))
    versions = {ip.version for ip, _ in resolved}
    if versions == {4}:
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in resolved)
    if versions == {6}:
        return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, port in resolved)
    raise ValueError(f"mixed IPv4 and IPv6 addresses in {list(addresses)}")


_HEALTH_STATUSES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def health_stub_args() -> dict[str, Any]:
    """The arguments of `channel.unary_unary` for grpc.health.v1.Health/Check.

    HealthCheckRequest {string service = 1} and HealthCheckResponse {enum status = 1} have the
    wire format of the protobuf wrappers StringValue and Int32Value, which saves a dependency.
    """
    return {
        "method": "/grpc.health.v1.Health/Check",
        "request_serializer": _health_request,
        "response_deserializer": wrappers_pb2.Int32Value.FromString,
    }


def _health_request(service: str) -> bytes:
    return bytes(wrappers_pb2.StringValue(value=service).SerializeToString())


def health_status(msg: wrappers_pb2.Int32Value) -> str:
    return _HEALTH_STATUSES.get(msg.value, str(msg.value))


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Attempts:
    """One call's retry state: the overall deadline and the attempts made so far."""

    def __init__(self, policy: RetryPolicy, timeout: float | None) -> None:
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.count = 1

    def timeout(self) -> float | None:
        """What is left of the call's timeout, for the next attempt."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def delay_after(self, exc: grpc.RpcError, *, can_retry: bool = True) -> float:
        """Seconds to wait before the next attempt; raises the typed error when there is none."""
        error = error_from_rpc(exc)
        delay = self.policy.delay_s(error, self.count) if can_retry else None
        remaining = self.timeout()
        if delay is None or (remaining is not None and delay >= remaining):
            raise error from exc
        self.count += 1
        return delay
