"""SMG's vLLM worker service (`vllm.grpc.engine.VllmEngine`) over the server core: the gateway
tokenizes, routes and detokenizes; this worker generates token ids. Admission, auth, drain,
time and stall limits and the log line are the same `Call` and `ServerState` as
asyncengine.v1's; only the messages differ."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from asyncengine.engine.kv_events import TooManySubscribersError
from asyncengine.errors import InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.outputs import RequestOutput
from asyncengine.server.call import LOGGED_ID_LEN, Call
from asyncengine.server.errors import (
    ClientStalledError,
    UnauthenticatedError,
    abort_rpc,
    set_final_status,
)
from asyncengine.server.state import ServerState
from asyncengine.server.stream_writer import StreamWriter
from asyncengine.server.vllm_worker import convert, info, kv_events
from asyncengine.server.vllm_worker.tokenizer_zip import TokenizerZip

logger = get_logger(__name__)
PROTOCOL = "smg"  # the log lines' protocol field
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
MAX_ABORT_IDS = 1024
MAX_FLUSH_WAIT_S = 60.0
FLUSH_POLL_S = 0.05


class VllmWorkerServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Generate, Abort, health, model/server info, loads, tokenizer and KV events."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._engine = state.engine
        self._tokenizer_zip = info.tokenizer_zip(state)
        self._tokenizer_zip.local_dir()  # made at start-up, not on the loop at the first call

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        request_id = request.request_id or uuid.uuid4().hex
        with structlog.contextvars.bound_contextvars(request_id=request_id[:LOGGED_ID_LEN]):
            try:
                call = await self._open(request, context, request_id)
            except Exception as exc:
                if isinstance(exc, InvalidRequestError):
                    # INVALID_ARGUMENT, which a gateway answers as a 400 and never retries
                    logger.info("request_refused", protocol=PROTOCOL, field=exc.field)
                await abort_rpc(context, exc)
            writer = StreamWriter(context, self._state)
            try:
                await self._stream(call, request, writer)
            except ClientStalledError as exc:
                call.fail(exc)
                set_final_status(context, exc)
            except BaseException as exc:
                call.fail(exc)
                if isinstance(exc, Exception):
                    await abort_rpc(context, exc, has_partial_output=writer.num_deltas > 0)
                raise
            finally:
                writer.close()
                await call.close()

    async def _open(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str
    ) -> Call:
        prompt, prompt_field = convert.prompt_of(request)
        try:
            prompt = convert.truncated(prompt, request.sampling_params)
            params = convert.sampling_params(request.sampling_params, request.stream)
        except InvalidRequestError as exc:
            raise convert.field_error(exc, prompt_field) from None
        tenant = self._state.tenants.identity(context.invocation_metadata() or ())
        call = Call(self._state, PROTOCOL, [request_id], tenant)

        def invalid(exc: InvalidRequestError, index: int | None) -> Exception:
            return exc if index is None else convert.field_error(exc, prompt_field)

        await call.open([prompt], params, invalid=invalid)
        return call

    async def _stream(self, call: Call, request: pb.GenerateRequest, writer: StreamWriter) -> None:
        """Streaming: a chunk per sample per output, a Complete as each sample ends.
        Otherwise one Complete per sample once the request is done."""
        params = request.sampling_params
        num_logprobs = params.logprobs if params.HasField("logprobs") else None
        num_prompt = params.prompt_logprobs if params.HasField("prompt_logprobs") else None
        num_tokens: dict[int, int] = {}
        prompt_logprobs: pb.InputLogProbs | None = None
        out: RequestOutput | None = None
        while out is None or not out.finished:
            ((_, out),) = await call.next_outputs(None)
            if prompt_logprobs is None:
                prompt_logprobs = convert.input_logprobs(out, num_prompt)
            for completion in out.outputs:
                index = completion.index
                is_first = index not in num_tokens
                num_tokens[index] = num_tokens.get(index, 0) + len(completion.token_ids)
                if not request.stream:
                    continue
                if completion.token_ids or is_first:
                    chunk = pb.GenerateStreamChunk(
                        token_ids=completion.token_ids,
                        prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=len(completion.token_ids),
                        cached_tokens=convert.cached_tokens(out),
                        output_logprobs=convert.output_logprobs(completion, num_logprobs),
                        input_logprobs=prompt_logprobs if is_first else None,
                        index=index,
                    )
                    writer.num_deltas += 1
                    await writer.write(pb.GenerateResponse(chunk=chunk))
                if completion.finish is not None:
                    msg = convert.complete(
                        out, completion, num_tokens[index], num_logprobs, num_prompt
                    )
                    await writer.write(pb.GenerateResponse(complete=msg))
        if not request.stream:
            for completion in out.outputs:
                msg = convert.complete(
                    out, completion, num_tokens[completion.index], num_logprobs, num_prompt
                )
                await writer.write(pb.GenerateResponse(complete=msg))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> Any:
        if len(request.request_ids) > MAX_ABORT_IDS:
            await abort_rpc(
                context,
                convert.InvalidFieldError("request_ids", f"at most {MAX_ABORT_IDS} ids per call"),
            )
        try:
            tenant, is_operator = self._state.tenants.abort_scope(
                context.invocation_metadata() or ()
            )
        except UnauthenticatedError as exc:
            await abort_rpc(context, exc)
        await self._state.abort_ids(request.request_ids, tenant, is_operator=is_operator)
        return pb.AbortResponse()

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        if self._engine.errored:
            return pb.HealthCheckResponse(healthy=False, message="the engine is dead")
        if self._state.is_draining:
            return pb.HealthCheckResponse(healthy=False, message="draining")
        return pb.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        return info.model_info(self._state)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        return info.server_info(self._state)

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> Any:
        return info.loads(self._state)

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        data, digest = await self._tokenizer_zip.get()
        for chunk in TokenizerZip.chunks(data, digest):
            yield chunk

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        """Forget the prefix cache (a `cleared` KV event) once no request holds a KV block,
        waiting up to `timeout_s` (at most MAX_FLUSH_WAIT_S) for that. Operators only, where
        tenants have tokens of their own."""
        try:
            _, is_operator = self._state.tenants.abort_scope(context.invocation_metadata() or ())
        except UnauthenticatedError as exc:
            await abort_rpc(context, exc)
        if not is_operator:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "FlushCache needs a Control token"
            )
        deadline = time.monotonic() + min(max(request.timeout_s, 0.0), MAX_FLUSH_WAIT_S)
        while not await self._engine.reset_prefix_cache():
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False, message="requests hold KV blocks; the cache was not flushed"
                )
            await asyncio.sleep(FLUSH_POLL_S)
        return common_pb2.FlushCacheResponse(success=True, message="the prefix cache is empty")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's events (`--enable-kv-events`; else UNIMPLEMENTED, which the
        gateway reads as "this worker publishes none"), from `start_sequence_number` on."""
        if not self._engine.config.cache_config.enable_kv_events:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "KV cache events are off (--enable-kv-events)"
            )
        if self._engine.errored:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is dead")
        try:
            subscription = self._engine.kv_events(request.start_sequence_number)
        except TooManySubscribersError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        block_size = self._engine.config.cache_config.block_size
        async with subscription:
            async for batch in subscription:
                yield kv_events.batch_message(batch, block_size)
