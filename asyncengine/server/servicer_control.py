"""The Control service: abort requests, describe the model and server, watch load, drain, resume,
and load, unload and list LoRA adapters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

import asyncengine
from asyncengine.errors import EngineDeadError
from asyncengine.lora.request import LoRARequest
from asyncengine.server import convert
from asyncengine.server.errors import (
    InvalidFieldError,
    ServerDrainingError,
    UnauthenticatedError,
    abort_rpc,
)
from asyncengine.server.state import ServerState
from asyncengine.v1 import control_pb2 as pb
from asyncengine.v1 import control_pb2_grpc

MAX_ABORT_IDS = 1024
# WatchLoad intervals below this are raised to it: load figures change once per step anyway
_MIN_WATCH_INTERVAL_S = 0.05


class ControlServicer(control_pb2_grpc.ControlServicer):
    """Management calls over the shared server state."""

    def __init__(self, state: ServerState) -> None:
        self._state = state

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> Any:
        if len(request.request_ids) > MAX_ABORT_IDS:
            error = InvalidFieldError("request_ids", f"at most {MAX_ABORT_IDS} ids per call")
            await abort_rpc(context, error)
        metadata = context.invocation_metadata() or ()
        try:
            tenant, is_operator = self._state.tenants.abort_scope(metadata)
        except UnauthenticatedError as exc:
            await abort_rpc(context, exc)
        # another tenant's id is answered as an unknown one: ignored, and not in aborted_ids
        aborted = await self._state.abort_ids(request.request_ids, tenant, is_operator=is_operator)
        return pb.AbortResponse(aborted_ids=aborted)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        engine = self._state.engine
        config = engine.config
        bos_token_id = engine.get_tokenizer().bos_token_id
        return pb.ModelInfo(
            model_name=self._state.model_name,
            architecture=config.model_config.architecture,
            max_context_length=config.model_config.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_ids=list(engine.eos_token_ids),
            bos_token_id=bos_token_id if isinstance(bos_token_id, int) else None,
            block_size=config.cache_config.block_size,
            dtype=config.model_config.dtype,
            device=config.device_config.device,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            max_queued_requests=self._state.options.max_queued_requests,
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        return pb.ServerInfo(
            version=asyncengine.__version__,
            load=convert.load_report(self._state.engine.get_stats(), self._state.num_admitted),
            uptime_s=time.monotonic() - self._state.started_at,
            draining=self._state.is_draining,
        )

    async def WatchLoad(
        self, request: pb.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LoadReport]:
        interval_s = max(_MIN_WATCH_INTERVAL_S, (request.interval_ms or 1000) / 1000)
        while True:
            yield convert.load_report(self._state.engine.get_stats(), self._state.num_admitted)
            await asyncio.sleep(interval_s)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> Any:
        grace_s = request.grace_period_ms / 1000 or self._state.options.drain_grace_period
        return pb.DrainResponse(aborted=await self._state.drain(grace_s))

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            was_draining = await self._state.resume()
        except (ServerDrainingError, EngineDeadError) as exc:  # shutting down, or engine dead
            await abort_rpc(context, exc)
        return pb.ResumeResponse(was_draining=was_draining)

    async def LoadLoRA(self, request: pb.LoadLoRARequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            adapter = await self._state.adapters.load(request.lora_name, request.lora_path)
        except Exception as exc:  # INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION
            await abort_rpc(context, exc)
        return self._adapter(adapter)

    async def UnloadLoRA(
        self, request: pb.UnloadLoRARequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            adapter = await self._state.adapters.unload(request.lora_name)
        except Exception as exc:  # NOT_FOUND, or FAILED_PRECONDITION while in use
            await abort_rpc(context, exc)
        return pb.UnloadLoRAResponse(adapter=self._adapter(adapter))

    async def ListLoRAs(
        self, request: pb.ListLoRAsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        return pb.ListLoRAsResponse(adapters=[self._adapter(a) for a in self._state.adapters.all()])

    def _adapter(self, adapter: LoRARequest) -> pb.LoRAAdapter:
        return pb.LoRAAdapter(
            lora_name=adapter.lora_name,
            lora_id=adapter.lora_int_id,
            lora_path=adapter.lora_path,
            base_model_name=self._state.model_name,
        )
