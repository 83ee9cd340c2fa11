"""The Generation service: GenerateStream, Generate, Tokenize and Detokenize translated to the
engine interface (`AsyncLLMEngine`) through the server core (`Call`: admission, time limits,
release, the log line). The engine checks every field and owns every request's state; this
file maps names and writes messages."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, NoReturn

import grpc
import structlog
from grpc_status import rpc_status

from asyncengine.engine.request_stream import RequestStream
from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import CompletionOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.server import convert
from asyncengine.server.abort_reason import AbortReason
from asyncengine.server.call import LOGGED_ID_LEN, Call, refusal_when_full
from asyncengine.server.errors import (
    ClientStalledError,
    InvalidFieldError,
    abort_rpc,
    set_final_status,
    status_for,
)
from asyncengine.server.state import ServerState
from asyncengine.server.stream_writer import StreamWriter
from asyncengine.v1 import generation_pb2 as pb
from asyncengine.v1 import generation_pb2_grpc

# a backlog (a reader that resumes) goes out in pieces, so other streams interleave with it
MAX_TOKENS_PER_DELTA = 64
MAX_TOKENIZE_TEXTS = 256
MAX_DETOKENIZE_SEQUENCES = 256
# offsets and token strings are Python objects, one per token, built under the GIL the serving
# loop needs: 400,000 of them stalled every stream for 0.5-1 s on a loaded 2-core machine.
# A byte-level token is at least one byte, so this bounds them before any work; counts and ids
# (built in C) stay bounded by max_prompt_bytes only.
MAX_DETAILED_TOKENIZE_BYTES = 65_536
# refusal statuses kept, by their details (they differ only when the admitted count passes
# the limit, which it does not): a burst's refusals build no status each
_MAX_CACHED_REFUSALS = 16


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Admits requests, hands them to the engine and streams what it makes."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._engine = state.engine
        self._tokenizer = state.engine.get_tokenizer()
        self._refusals: dict[str, Any] = {}

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        refusal = refusal_when_full(self._state)
        if refusal is not None:  # before anything is built for the request
            await self._refuse(context, refusal)
        request_id = request.request_id or uuid.uuid4().hex
        with structlog.contextvars.bound_contextvars(request_id=request_id[:LOGGED_ID_LEN]):
            try:
                call, accepted = await self._open(request, context, request_id)
            except Exception as exc:
                await abort_rpc(context, exc)
            writer = StreamWriter(context, self._state)
            try:
                await self._stream(call, accepted, request.response, writer)
            except ClientStalledError as exc:
                call.fail(exc)
                set_final_status(context, exc)  # not abort: it would wait for the reader
            except BaseException as exc:
                call.fail(exc)
                if isinstance(exc, Exception):
                    await abort_rpc(context, exc, has_partial_output=writer.num_deltas > 0)
                raise
            finally:
                writer.close()
                await call.close()

    async def Generate(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            if not request.prompts:
                raise InvalidFieldError("prompts", "at least one prompt is required")
            call = await self._open_batch(request, context, uuid.uuid4().hex)
        except Exception as exc:
            await abort_rpc(context, exc)
        try:
            finals = await call.collect()
        except BaseException as exc:
            call.fail(exc)
            if isinstance(exc, Exception):
                await abort_rpc(context, exc)
            raise
        finally:
            await call.close()
        results = []
        for index, final in enumerate(finals):
            finished = self._finished(call.abort_reason(index), final.outputs[0])
            results.append(
                convert.generate_result(
                    call.request_ids[index], final, finished, request.response, self._tokenizer
                )
            )
        return pb.GenerateBatchResponse(results=results)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> Any:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            self._check_tokenize(request)
        except InvalidFieldError as exc:
            await abort_rpc(context, exc)
        results = []
        for i, text in enumerate(request.texts):
            try:
                encoded = await self._engine.tokenize(
                    text,
                    add_special_tokens=add_special,
                    return_offsets_mapping=request.return_offsets,
                )
            except InvalidRequestError as exc:
                await abort_rpc(context, convert.field_error(exc, f"texts[{i}]"))
            ids = list(encoded["input_ids"])
            tokens = await self._engine.convert_ids_to_tokens(ids) if request.return_tokens else []
            # one message per token, built off the loop: a long text must not stall streams
            result = await asyncio.to_thread(
                _tokenize_result, encoded, tokens, request.truncate, request.return_tokens
            )
            results.append(result)
        return pb.TokenizeResponse(results=results)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        try:
            self._check_detokenize(request)
        except InvalidFieldError as exc:
            await abort_rpc(context, exc)
        texts = []
        for i, seq in enumerate(request.sequences):
            try:
                texts.append(await self._engine.detokenize(list(seq.ids), skip))
            except InvalidRequestError as exc:
                await abort_rpc(context, convert.field_error(exc, f"sequences[{i}].ids"))
        return pb.DetokenizeResponse(texts=texts)

    async def _refuse(self, context: grpc.aio.ServicerContext, refusal: Exception) -> NoReturn:
        """End the call with RESOURCE_EXHAUSTED and its RetryInfo, the status built once."""
        details = str(refusal)
        status = self._refusals.get(details)
        if status is None:
            if len(self._refusals) >= _MAX_CACHED_REFUSALS:
                self._refusals.clear()
            status = self._refusals[details] = rpc_status.to_status(status_for(refusal))
        await context.abort(status.code, status.details, status.trailing_metadata)
        raise AssertionError("abort returned")  # it always raises

    # -- bounds of the tokenizer calls -------------------------------------------------------

    def _check_tokenize(self, request: pb.TokenizeRequest) -> None:
        if request.return_offsets and not self._tokenizer.is_fast:
            raise InvalidFieldError("return_offsets", "needs a fast tokenizer")
        if len(request.texts) > MAX_TOKENIZE_TEXTS:
            raise InvalidFieldError("texts", f"at most {MAX_TOKENIZE_TEXTS} texts per call")
        # the tokenizer thread is shared with prompts: one call may not hold it for long
        max_bytes = self._engine.config.scheduler_config.max_prompt_bytes
        if sum(len(text) for text in request.texts) > max_bytes:
            raise InvalidFieldError(
                "texts", f"more than {max_bytes} characters in all (max_prompt_bytes)"
            )
        if request.return_offsets or request.return_tokens:
            num_bytes = sum(len(text.encode()) for text in request.texts)
            if num_bytes > MAX_DETAILED_TOKENIZE_BYTES:
                raise InvalidFieldError(
                    "return_offsets" if request.return_offsets else "return_tokens",
                    f"is for at most {MAX_DETAILED_TOKENIZE_BYTES} bytes of text per call "
                    f"({num_bytes} here); ask for ids and counts only, or send the text in parts",
                )

    def _check_detokenize(self, request: pb.DetokenizeRequest) -> None:
        if len(request.sequences) > MAX_DETOKENIZE_SEQUENCES:
            raise InvalidFieldError(
                "sequences", f"at most {MAX_DETOKENIZE_SEQUENCES} sequences per call"
            )
        max_ids = 4 * self._engine.max_model_len
        if sum(len(seq.ids) for seq in request.sequences) > max_ids:
            raise InvalidFieldError("sequences", f"more than {max_ids} token ids in all")

    # -- one request -------------------------------------------------------------------------

    @staticmethod
    def _sampling_params(request: Any, kind: RequestOutputKind) -> SamplingParams:
        try:
            constraint = convert.structured_outputs(request)
            return convert.sampling_params(
                request.sampling, request.stopping, request.response, kind, constraint
            )
        except InvalidRequestError as exc:
            raise convert.field_error(exc, "") from None

    async def _open(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str
    ) -> tuple[Call, pb.Accepted]:
        """Admit one request and hand it to the engine; its call and what Accepted reports
        but the prompt. Bad input raises InvalidFieldError."""
        prompt, prompt_field = convert.prompt_of(request)
        params = self._sampling_params(request, RequestOutputKind.DELTA)
        adapter = self._state.adapters.resolve(request.lora_name)
        call = self._call(request, context, [request_id])
        accepted = pb.Accepted(
            request_id=request_id,
            seed=params.seed or 0,  # so the client can replay a random request
            queue_position=self._engine.get_stats().num_waiting,  # waiting when it came
        )
        await call.open(
            [prompt],
            params,
            request.priority,
            request.cache_salt or None,
            invalid=lambda exc, index: _field_error(exc, [prompt_field], index),
            lora_request=adapter,
        )
        return call, accepted

    async def _open_batch(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext, batch_id: str
    ) -> Call:
        """Admit every prompt of a batch (all or none) and hand them to the engine."""
        params = self._sampling_params(request, RequestOutputKind.FINAL_ONLY)
        if params.n != 1:  # a batch result has room for one sample per prompt
            raise InvalidFieldError("sampling.n", "n > 1 is supported by GenerateStream only")
        self._state.check_batch_size(len(request.prompts))  # before anything is built per prompt
        prompts = [convert.prompt_of(p, f"prompts[{i}].") for i, p in enumerate(request.prompts)]
        adapter = self._state.adapters.resolve(request.lora_name)
        call = self._call(request, context, [f"{batch_id}-{i}" for i in range(len(prompts))])
        fields = [field for _, field in prompts]
        await call.open(
            [prompt for prompt, _ in prompts],
            params,
            request.priority,
            request.cache_salt or None,
            invalid=lambda exc, index: _field_error(exc, fields, index),
            lora_request=adapter,
        )
        return call

    def _call(self, request: Any, context: grpc.aio.ServicerContext, ids: list[str]) -> Call:
        tenant = self._state.tenants.identity(context.invocation_metadata() or ())
        time_limit_ms = request.stopping.time_limit_ms
        time_limit_s = time_limit_ms / 1000 if time_limit_ms else None
        return Call(self._state, "grpc", ids, tenant, time_limit_s)

    async def _stream(
        self, call: Call, accepted: pb.Accepted, options: pb.ResponseOptions, writer: StreamWriter
    ) -> None:
        """Accepted, then Delta and Heartbeat messages, then Finished per sample and Usage."""
        (stream,) = call.streams
        await writer.write(self._accepted(accepted, stream, options))
        heartbeat_s = self._state.options.heartbeat_interval
        num_top = options.logprobs if options.HasField("logprobs") else None
        # each sample's token count so far, and its latest delta with tokens (its last token)
        # and finish: not its text and tokens, which a long output would copy per delta
        num_tokens: dict[int, int] = {}
        latest: dict[int, CompletionOutput] = {}
        out = None
        while out is None or not out.finished:
            ready = await call.next_outputs(heartbeat_s)
            if not ready:
                phase = convert.phase(self._engine.request_phase(call.flights[0].engine_id))
                seq = writer.next_sequence_number()
                await writer.write(
                    pb.GenerateResponse(heartbeat=pb.Heartbeat(phase=phase, sequence_number=seq))
                )
                continue
            ((_, out),) = ready
            for delta in out.outputs:
                offset = num_tokens.get(delta.index, 0)
                for msg in self._deltas(delta, offset, options, num_top, writer):
                    writer.num_deltas += 1
                    await writer.write(pb.GenerateResponse(delta=msg))
                num_tokens[delta.index] = offset + len(delta.token_ids)
                last = latest.get(delta.index)
                if last is not None and not delta.token_ids:  # a finish alone
                    last.finish, last.stop_reason = delta.finish, delta.stop_reason
                else:
                    latest[delta.index] = delta
        for index in sorted(latest):
            finished = self._finished(call.abort_reason(0), latest[index])
            finished.sequence_number = writer.next_sequence_number()
            await writer.write(pb.GenerateResponse(finished=finished))
        usage = convert.usage(out, writer.next_sequence_number())
        usage.completion_tokens = call.num_completion_tokens()
        await writer.write(pb.GenerateResponse(usage=usage))

    def _deltas(
        self,
        completion: CompletionOutput,
        token_offset: int,
        options: pb.ResponseOptions,
        num_top: int | None,
        writer: StreamWriter,
    ) -> list[pb.Delta]:
        """One DELTA output as Delta messages of at most MAX_TOKENS_PER_DELTA tokens each."""
        if not completion.text and not completion.token_ids:
            return []
        deltas = []
        token_ids = completion.token_ids
        for start in range(0, max(1, len(token_ids)), MAX_TOKENS_PER_DELTA):
            chunk = token_ids[start : start + MAX_TOKENS_PER_DELTA]
            msg = pb.Delta(
                sample_index=completion.index,
                sequence_number=writer.next_sequence_number(),
                token_offset=token_offset + start,
                text=completion.text if start == 0 else "",
                completion_tokens=token_offset + start + len(chunk),
            )
            if options.return_token_ids:
                msg.token_ids.extend(chunk)
            if num_top is not None and completion.logprobs is not None:
                entries = completion.logprobs[start : start + MAX_TOKENS_PER_DELTA]
                msg.logprobs.extend(convert.logprobs(entries, chunk, num_top, self._tokenizer))
            deltas.append(msg)
        return deltas

    @staticmethod
    def _finished(abort_reason: AbortReason | None, completion: CompletionOutput) -> pb.Finished:
        reason, stop_string, stop_token_id = convert.finish_reason(completion, abort_reason)
        return pb.Finished(
            sample_index=completion.index,
            reason=reason,  # type: ignore[arg-type]
            stop_string=stop_string,
            stop_token_id=stop_token_id,
        )

    def _accepted(
        self, accepted: pb.Accepted, stream: RequestStream, options: pb.ResponseOptions
    ) -> pb.GenerateResponse:
        token_ids = stream.prompt_token_ids
        accepted.prompt_tokens = len(token_ids)
        if options.echo_prompt:
            prompt = stream.prompt
            if prompt is None:
                prompt = str(self._tokenizer.decode(token_ids, skip_special_tokens=False))
            accepted.prompt_text = prompt
            accepted.prompt_token_ids.extend(token_ids)
        return pb.GenerateResponse(accepted=accepted)


def _field_error(
    exc: InvalidRequestError, prompt_fields: list[str], index: int | None
) -> Exception:
    """The engine's error named by the request's field; an admission error (index None:
    the call's size or id) is named as it is."""
    return exc if index is None else convert.field_error(exc, prompt_fields[index])


def _tokenize_result(
    encoded: Any, tokens: list[str], truncate: int, return_tokens: bool
) -> pb.TokenizeResult:
    ids, offsets = list(encoded["input_ids"]), encoded.get("offset_mapping") or []
    if truncate and len(ids) > truncate:
        # keep the end, as prompts are truncated (the start is usually the least needed)
        ids, offsets, tokens = ids[-truncate:], offsets[-truncate:], tokens[-truncate:]
    result = pb.TokenizeResult(token_ids=ids, token_count=len(ids))
    if return_tokens:
        result.tokens.extend(tokens)
    result.offsets.extend(pb.Offset(start=s, end=e) for s, e in offsets)
    return result
