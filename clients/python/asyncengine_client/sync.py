"""The blocking client, on grpc's sync channel; the same surface as `AsyncClient`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from asyncengine_client import results
from asyncengine_client.options import (
    DEFAULT_TARGET,
    NO_RETRY,
    Attempts,
    GenerateOptions,
    RetryPolicy,
    Tls,
    batch_request,
    call_metadata,
    channel_config,
    health_status,
    health_stub_args,
    stream_request,
)
from asyncengine_client.v1 import control_pb2, generation_pb2
from asyncengine_client.v1.control_pb2_grpc import ControlStub
from asyncengine_client.v1.generation_pb2_grpc import GenerationStub

T = TypeVar("T")


class Client:
    """A blocking client of an asyncengine server (or of several, balanced round-robin).

    The arguments are those of `AsyncClient`. Use it as `with Client(...) as client:`, or call
    `close()`.
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: Tls | grpc.ChannelCredentials | None = None,
        round_robin: bool | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, str | int]] = (),
    ) -> None:
        config = channel_config(target, tls=tls, round_robin=round_robin, options=options)
        if config.credentials is None:
            self._channel = grpc.insecure_channel(config.target, options=config.options)
        else:
            self._channel = grpc.secure_channel(
                config.target, config.credentials, options=config.options
            )
        self._generation = GenerationStub(self._channel)
        self._control = ControlStub(self._channel)
        self._health_check = self._channel.unary_unary(**health_stub_args())
        self._metadata = call_metadata(token)
        self._retry = retry or RetryPolicy()
        self._timeout = timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate_stream(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        timeout: float | None = None,
        **options: Any,
    ) -> Iterator[results.StreamEvent]:
        """Stream one prompt: Accepted, then Delta / Heartbeat, Finished per sample, Usage.

        `options` are `GenerateOptions` fields. Leaving the loop early cancels the request.
        """
        request = stream_request(prompt, GenerateOptions(**options), request_id)
        return self._stream(self._generation.GenerateStream, request, timeout, results.stream_event)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> list[results.Completion]:
        """Generate for every prompt with one parameter set; completions in prompt order."""
        request = batch_request(prompts, GenerateOptions(**options))
        response = self._unary(self._generation.Generate, request, timeout)
        return [results.completion(result) for result in response.results]

    def tokenize(
        self,
        texts: Sequence[str],
        *,
        add_special_tokens: bool | None = None,
        return_tokens: bool = False,
        return_offsets: bool = False,
        truncate: int = 0,
        timeout: float | None = None,
    ) -> list[results.TokenizeResult]:
        request = generation_pb2.TokenizeRequest(
            texts=texts,
            add_special_tokens=add_special_tokens,
            return_tokens=return_tokens,
            return_offsets=return_offsets,
            truncate=truncate,
        )
        response = self._unary(self._generation.Tokenize, request, timeout)
        return [results.tokenize_result(result) for result in response.results]

    def detokenize(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        skip_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        request = generation_pb2.DetokenizeRequest(
            sequences=[generation_pb2.TokenIds(ids=ids) for ids in sequences],
            skip_special_tokens=skip_special_tokens,
        )
        return list(self._unary(self._generation.Detokenize, request, timeout).texts)

    def abort(self, request_ids: Sequence[str], *, timeout: float | None = None) -> list[str]:
        """Abort requests by id (idempotent); returns the ids that were still in flight. A
        tenant's token reaches its own tenant's requests only; a Control token, anyone's."""
        request = control_pb2.AbortRequest(request_ids=request_ids)
        return list(self._unary(self._control.Abort, request, timeout).aborted_ids)

    def drain(self, grace_period_ms: int = 0, *, timeout: float | None = None) -> int:
        """Stop admission and turn health NOT_SERVING; how many requests had to be aborted.

        Requests in flight get `grace_period_ms` (0: the server's default) to finish first.
        """
        request = control_pb2.DrainRequest(grace_period_ms=grace_period_ms)
        return int(self._unary(self._control.Drain, request, timeout).aborted)

    def resume(self, *, timeout: float | None = None) -> bool:
        """Undo a drain (not a shutdown's): admission reopens and health is SERVING again.

        Returns whether the server was draining; on one that was not, a no-op.
        """
        request = control_pb2.ResumeRequest()
        return bool(self._unary(self._control.Resume, request, timeout).was_draining)

    def model_info(self, *, timeout: float | None = None) -> results.ModelInfo:
        msg = self._unary(self._control.GetModelInfo, control_pb2.GetModelInfoRequest(), timeout)
        return results.from_proto(results.ModelInfo, msg)

    def server_info(self, *, timeout: float | None = None) -> results.ServerInfo:
        request = control_pb2.GetServerInfoRequest()
        return results.server_info(self._unary(self._control.GetServerInfo, request, timeout))

    def load_lora(
        self, lora_name: str, lora_path: str, *, timeout: float | None = None
    ) -> results.LoRAAdapter:
        """Load the PEFT adapter in `lora_path` (on the server's host) as `lora_name`; needs a
        server with --allow-runtime-lora-updating and a Control token."""
        request = control_pb2.LoadLoRARequest(lora_name=lora_name, lora_path=lora_path)
        msg = self._unary(self._control.LoadLoRA, request, timeout)
        return results.from_proto(results.LoRAAdapter, msg)

    def unload_lora(self, lora_name: str, *, timeout: float | None = None) -> results.LoRAAdapter:
        """Unload an adapter; FAILED_PRECONDITION (LORA_IN_USE) while requests still use it."""
        request = control_pb2.UnloadLoRARequest(lora_name=lora_name)
        msg = self._unary(self._control.UnloadLoRA, request, timeout)
        return results.from_proto(results.LoRAAdapter, msg.adapter)

    def list_loras(self, *, timeout: float | None = None) -> list[results.LoRAAdapter]:
        """The adapters the server serves, in load order."""
        msg = self._unary(self._control.ListLoRAs, control_pb2.ListLoRAsRequest(), timeout)
        return [results.from_proto(results.LoRAAdapter, a) for a in msg.adapters]

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status of `service` ("" is the whole server): "SERVING", ..."""
        return health_status(self._unary(self._health_check, service, timeout, NO_RETRY))

    def watch_load(
        self, interval_ms: int = 0, *, timeout: float | None = None
    ) -> Iterator[results.LoadReport]:
        """The server's load every `interval_ms` (0: the server's default, 1 s)."""
        request = control_pb2.WatchLoadRequest(interval_ms=interval_ms)
        return self._stream(self._control.WatchLoad, request, timeout, results.load_report)

    def _unary(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout: float | None,
        retry: RetryPolicy | None = None,
    ) -> Any:
        attempts = Attempts(retry or self._retry, timeout or self._timeout)
        while True:
            try:
                return method(request, timeout=attempts.timeout(), metadata=self._metadata)
            except grpc.RpcError as exc:
                time.sleep(attempts.delay_after(exc))

    def _stream(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout: float | None,
        convert: Callable[[Any], T],
    ) -> Iterator[T]:
        attempts = Attempts(self._retry, timeout or self._timeout)
        while True:
            call = method(request, timeout=attempts.timeout(), metadata=self._metadata)
            has_received = False
            try:
                for msg in call:
                    has_received = True
                    yield convert(msg)
                return
            except grpc.RpcError as exc:
                # once anything arrived, a retry would repeat it: only a fresh stream retries
                delay = attempts.delay_after(exc, can_retry=not has_received)
            finally:
                call.cancel()
            time.sleep(delay)
