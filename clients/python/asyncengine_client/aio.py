"""The asyncio client, on grpc.aio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

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


class AsyncClient:
    """An asyncio client of an asyncengine server (or of several, balanced round-robin).

    `target` is "host:port", a gRPC target URI, or a list of "host:port" to balance over.
    `token` is sent as `authorization: Bearer <token>`; `tls` is a `Tls` or grpc channel
    credentials (None: plaintext). `timeout` (seconds) is the default per call, retries
    included. Use it as `async with AsyncClient(...) as client:`, or call `close()`.
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
            self._channel = grpc.aio.insecure_channel(config.target, options=config.options)
        else:
            self._channel = grpc.aio.secure_channel(
                config.target, config.credentials, options=config.options
            )
        self._generation = GenerationStub(self._channel)
        self._control = ControlStub(self._channel)
        self._health_check = self._channel.unary_unary(**health_stub_args())
        self._metadata = call_metadata(token)
        self._retry = retry or RetryPolicy()
        self._timeout = timeout

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def generate_stream(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        timeout: float | None = None,
        **options: Any,
    ) -> AsyncIterator[results.StreamEvent]:
        """Stream one prompt: Accepted, then Delta / Heartbeat, Finished per sample, Usage.

        `options` are `GenerateOptions` fields (max_new_tokens, temperature, stop, ...).
        Leaving the loop early cancels the request on the server; wrap the iterator in
        `contextlib.aclosing` to do that at once rather than when it is garbage-collected.
        """
        request = stream_request(prompt, GenerateOptions(**options), request_id)
        return self._stream(self._generation.GenerateStream, request, timeout, results.stream_event)

    async def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> list[results.Completion]:
        """Generate for every prompt with one parameter set; completions in prompt order."""
        request = batch_request(prompts, GenerateOptions(**options))
        response = await self._unary(self._generation.Generate, request, timeout)
        return [results.completion(result) for result in response.results]

    async def tokenize(
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
        response = await self._unary(self._generation.Tokenize, request, timeout)
        return [results.tokenize_result(result) for result in response.results]

    async def detokenize(
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
        response = await self._unary(self._generation.Detokenize, request, timeout)
        return list(response.texts)

    async def abort(self, request_ids: Sequence[str], *, timeout: float | None = None) -> list[str]:
        """Abort requests by id (idempotent); returns the ids that were still in flight. A
        tenant's token reaches its own tenant's requests only; a Control token, anyone's."""
        request = control_pb2.AbortRequest(request_ids=request_ids)
        response = await self._unary(self._control.Abort, request, timeout)
        return list(response.aborted_ids)

    async def drain(self, grace_period_ms: int = 0, *, timeout: float | None = None) -> int:
        """Stop admission and turn health NOT_SERVING; how many requests had to be aborted.

        Requests in flight get `grace_period_ms` (0: the server's default) to finish first.
        """
        request = control_pb2.DrainRequest(grace_period_ms=grace_period_ms)
        return int((await self._unary(self._control.Drain, request, timeout)).aborted)

    async def resume(self, *, timeout: float | None = None) -> bool:
        """Undo a drain (not a shutdown's): admission reopens and health is SERVING again.

        Returns whether the server was draining; on one that was not, a no-op.
        """
        request = control_pb2.ResumeRequest()
        return bool((await self._unary(self._control.Resume, request, timeout)).was_draining)

    async def model_info(self, *, timeout: float | None = None) -> results.ModelInfo:
        request = control_pb2.GetModelInfoRequest()
        msg = await self._unary(self._control.GetModelInfo, request, timeout)
        return results.from_proto(results.ModelInfo, msg)

    async def server_info(self, *, timeout: float | None = None) -> results.ServerInfo:
        request = control_pb2.GetServerInfoRequest()
        return results.server_info(await self._unary(self._control.GetServerInfo, request, timeout))

    async def load_lora(
        self, lora_name: str, lora_path: str, *, timeout: float | None = None
    ) -> results.LoRAAdapter:
        """Load the PEFT adapter in `lora_path` (on the server's host) as `lora_name`; needs a
        server with --allow-runtime-lora-updating and a Control token."""
        request = control_pb2.LoadLoRARequest(lora_name=lora_name, lora_path=lora_path)
        msg = await self._unary(self._control.LoadLoRA, request, timeout)
        return results.from_proto(results.LoRAAdapter, msg)

    async def unload_lora(
        self, lora_name: str, *, timeout: float | None = None
    ) -> results.LoRAAdapter:
        """Unload an adapter; FAILED_PRECONDITION (LORA_IN_USE) while requests still use it."""
        request = control_pb2.UnloadLoRARequest(lora_name=lora_name)
        msg = await self._unary(self._control.UnloadLoRA, request, timeout)
        return results.from_proto(results.LoRAAdapter, msg.adapter)

    async def list_loras(self, *, timeout: float | None = None) -> list[results.LoRAAdapter]:
        """The adapters the server serves, in load order."""
        request = control_pb2.ListLoRAsRequest()
        msg = await self._unary(self._control.ListLoRAs, request, timeout)
        return [results.from_proto(results.LoRAAdapter, a) for a in msg.adapters]

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status of `service` ("" is the whole server): "SERVING", ..."""
        msg = await self._unary(self._health_check, service, timeout, NO_RETRY)
        return health_status(msg)

    def watch_load(
        self, interval_ms: int = 0, *, timeout: float | None = None
    ) -> AsyncIterator[results.LoadReport]:
        """The server's load every `interval_ms` (0: the server's default, 1 s)."""
        request = control_pb2.WatchLoadRequest(interval_ms=interval_ms)
        return self._stream(self._control.WatchLoad, request, timeout, results.load_report)

    async def _unary(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout: float | None,
        retry: RetryPolicy | None = None,
    ) -> Any:
        attempts = Attempts(retry or self._retry, timeout or self._timeout)
        while True:
            try:
                return await method(request, timeout=attempts.timeout(), metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                await asyncio.sleep(attempts.delay_after(exc))

    async def _stream(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout: float | None,
        convert: Callable[[Any], T],
    ) -> AsyncIterator[T]:
        attempts = Attempts(self._retry, timeout or self._timeout)
        while True:
            call = method(request, timeout=attempts.timeout(), metadata=self._metadata)
            has_received = False
            try:
                async for msg in call:
                    has_received = True
                    yield convert(msg)
                return
            except grpc.aio.AioRpcError as exc:
                # once anything arrived, a retry would repeat it: only a fresh stream retries
                delay = attempts.delay_after(exc, can_retry=not has_received)
            finally:
                call.cancel()  # a no-op once finished; abandoned aio calls are not collected
            await asyncio.sleep(delay)
