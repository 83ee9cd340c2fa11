"""The Generation service: a thin translation of GenerateStream, Generate and tokenizing."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import structlog

from asyncengine.errors import InvalidRequestError
from asyncengine.logging import get_logger
from asyncengine.outputs import RequestOutput
from asyncengine.server import convert
from asyncengine.server.errors import InvalidFieldError, abort_rpc
from asyncengine.server.state import Flight, ServerState
from asyncengine.server.stream import DeltaTracker, EngineStream, follow
from asyncengine.v1 import generation_pb2 as pb
from asyncengine.v1 import generation_pb2_grpc

MAX_CACHE_SALT_LEN = 256

logger = get_logger(__name__)


class _Outcome:
    """What the per-request log line reports."""

    def __init__(self) -> None:
        self.final: RequestOutput | None = None
        self.finish_reason = "UNFINISHED"
        self.num_deltas = 0


def _failure_label(exc: BaseException) -> str:
    """How a request that did not finish ended, for its log line."""
    if isinstance(exc, asyncio.CancelledError):
        return "CLIENT_CANCELLED"  # the client cancelled, or its deadline passed
    return type(exc).__name__


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Validates, admits and streams requests; everything else is the engine's."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._llm = state.engine.engine
        self._tokenizer = self._llm.tokenizer
        self._max_model_len = self._llm.config.model_config.max_model_len
        self._block_size = self._llm.config.cache_config.block_size
        self._max_num_seqs = self._llm.config.scheduler_config.max_num_seqs

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            outcome = _Outcome()
            try:
                flight = self._prepare(request, request, request_id, "")
                queue_position = self._state.engine.get_stats().num_waiting
                (stream,) = await self._open([flight])
            except Exception as exc:
                await abort_rpc(context, exc)
            try:
                yield self._accepted(flight, request.response, queue_position)
                events = self._events(flight, stream, request.response, outcome)
                async with contextlib.aclosing(events):
                    async for msg in events:
                        yield msg
            except BaseException as exc:
                outcome.finish_reason = _failure_label(exc)
                if isinstance(exc, Exception):
                    await abort_rpc(context, exc, has_partial_output=outcome.num_deltas > 0)
                raise
            finally:
                await self._close(flight, stream, outcome)

    async def Generate(
        self, request: pb.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        batch_id = uuid.uuid4().hex
        try:
            if not request.prompts:
                raise InvalidFieldError("prompts", "at least one prompt is required")
            flights = [
                self._prepare(request, prompt, f"{batch_id}-{i}", f"prompts[{i}].")
                for i, prompt in enumerate(request.prompts)
            ]
            streams = await self._open(flights)
        except Exception as exc:
            await abort_rpc(context, exc)
        outcomes = [_Outcome() for _ in flights]
        try:
            await asyncio.gather(*map(self._collect, flights, streams, outcomes))
        except BaseException as exc:
            for outcome in outcomes:
                if outcome.finish_reason == "UNFINISHED":
                    outcome.finish_reason = _failure_label(exc)
            if isinstance(exc, Exception):
                await abort_rpc(context, exc)
            raise
        finally:
            for flight, stream, outcome in zip(flights, streams, outcomes):
                await self._close(flight, stream, outcome)
        results = []
        for flight, outcome in zip(flights, outcomes):
            assert outcome.final is not None
            finished = self._finished(flight, outcome)
            results.append(
                convert.generate_result(outcome.final, finished, request.response, self._tokenizer)
            )
        return pb.GenerateBatchResponse(results=results)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> Any:
        tokenizer = self._tokenizer
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        if request.return_offsets and not tokenizer.is_fast:
            await abort_rpc(context, InvalidFieldError("return_offsets", "needs a fast tokenizer"))
        results = []
        for text in request.texts:
            encoded = tokenizer(
                text, add_special_tokens=add_special, return_offsets_mapping=request.return_offsets
            )
            ids, offsets = list(encoded["input_ids"]), encoded.get("offset_mapping") or []
            if request.truncate and len(ids) > request.truncate:
                # keep the end, as prompts are truncated (the start is usually the least needed)
                ids, offsets = ids[-request.truncate :], offsets[-request.truncate :]
            result = pb.TokenizeResult(token_ids=ids, token_count=len(ids))
            if request.return_tokens:
                result.tokens.extend(tokenizer.convert_ids_to_tokens(ids))
            result.offsets.extend(pb.Offset(start=s, end=e) for s, e in offsets)
            results.append(result)
        return pb.TokenizeResponse(results=results)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        vocab_size = self._llm.vocab_size
        for i, seq in enumerate(request.sequences):
            bad = [t for t in seq.ids if t >= vocab_size]
            if bad:
                error = InvalidFieldError(
                    f"sequences[{i}].ids", f"token ids must be < {vocab_size}, got {bad[:5]}"
                )
                await abort_rpc(context, error)
        texts = [
            str(self._tokenizer.decode(list(seq.ids), skip_special_tokens=skip))
            for seq in request.sequences
        ]
        return pb.DetokenizeResponse(texts=texts)

    # -- one request -------------------------------------------------------------------------

    def _prepare(self, request: Any, prompt_source: Any, request_id: str, prefix: str) -> Flight:
        """Validate one prompt with the request's options; bad input raises InvalidFieldError."""
        prompt, prompt_field = convert.prompt_of(prompt_source, prefix)
        params = convert.sampling_params(request.sampling, request.stopping, request.response)
        try:
            token_ids = self._llm.tokenize(prompt)
        except InvalidRequestError as exc:
            raise InvalidFieldError(prompt_field, str(exc)) from exc
        num_tokens, max_len = len(token_ids), self._max_model_len
        if num_tokens >= max_len:
            raise InvalidFieldError(
                prompt_field,
                f"the prompt is {num_tokens} tokens: no room for output within the context "
                f"length ({max_len})",
            )
        cache_len = self._state.engine.get_stats().num_gpu_blocks * self._block_size
        if num_tokens > cache_len:
            raise InvalidFieldError(
                prompt_field, f"the prompt is {num_tokens} tokens; the KV cache holds {cache_len}"
            )
        if params.max_tokens is not None and num_tokens + params.max_tokens > max_len:
            raise InvalidFieldError(
                "stopping.max_new_tokens",
                f"prompt ({num_tokens} tokens) + max_new_tokens ({params.max_tokens}) exceeds "
                f"the context length ({max_len})",
            )
        if params.n != 1 and prefix:  # a batch result has room for one sample per prompt
            raise InvalidFieldError("sampling.n", "n > 1 is supported by GenerateStream only")
        if params.n > self._max_num_seqs:  # the samples run at once, one sequence each
            raise InvalidFieldError(
                "sampling.n", f"must be <= the server's max_num_seqs ({self._max_num_seqs})"
            )
        if len(request.cache_salt) > MAX_CACHE_SALT_LEN:
            raise InvalidFieldError(
                "cache_salt", f"must be at most {MAX_CACHE_SALT_LEN} characters"
            )
        time_limit_ms = request.stopping.time_limit_ms
        return Flight(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=token_ids,
            params=params,
            priority=request.priority,
            cache_salt=request.cache_salt or None,
            time_limit_s=time_limit_ms / 1000 if time_limit_ms else None,
        )

    async def _open(self, flights: list[Flight]) -> list[EngineStream]:
        """Admit the flights and hand them to the engine (all or none)."""
        self._state.admit(flights)
        streams = [EngineStream(self._state.engine, flight) for flight in flights]
        try:
            for stream in streams:
                await stream.start()
        except BaseException:
            for flight, stream in zip(flights, streams):
                await stream.close()
                self._state.release(flight)
            raise
        return streams

    async def _close(self, flight: Flight, stream: EngineStream, outcome: _Outcome) -> None:
        await stream.close()
        self._state.release(flight)
        usage = convert.usage(outcome.final) if outcome.final else pb.Usage()
        logger.info(
            "request_finished",
            request_id=flight.request_id,
            finish_reason=outcome.finish_reason,
            prompt_tokens=len(flight.prompt_token_ids),
            completion_tokens=usage.completion_tokens,
            time_to_first_token_s=round(usage.time_to_first_token_s, 4),
            total_s=round(time.monotonic() - flight.admitted_at, 4),
            preemptions=usage.preemptions,
        )

    async def _events(
        self, flight: Flight, stream: EngineStream, options: pb.ResponseOptions, outcome: _Outcome
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Delta and Heartbeat messages, then Finished and Usage (Accepted is message 0)."""
        seq = 1
        num_top = options.logprobs if options.HasField("logprobs") else None
        # one tracker per sample: with n > 1 each sample streams its own deltas
        trackers = [
            DeltaTracker(flight, num_top, options.return_token_ids) for _ in range(flight.params.n)
        ]
        heartbeat_s = self._state.options.heartbeat_interval
        async with contextlib.aclosing(follow(self._state, flight, stream, heartbeat_s)) as outs:
            async for out in outs:
                if out is None:
                    phase = convert.phase(self._state.engine.request_phase(flight.request_id))
                    yield pb.GenerateResponse(
                        heartbeat=pb.Heartbeat(phase=phase, sequence_number=seq)
                    )
                    seq += 1
                    continue
                outcome.final = out
                for completion in out.outputs:
                    tracker = trackers[completion.index]
                    delta = tracker.delta(out, seq, self._tokenizer, completion.index)
                    if delta is not None:
                        outcome.num_deltas += 1
                        seq += 1
                        yield pb.GenerateResponse(delta=delta)
        assert outcome.final is not None
        for completion in outcome.final.outputs:
            finished = self._finished(flight, outcome, completion.index)
            finished.sequence_number = seq
            seq += 1
            yield pb.GenerateResponse(finished=finished)
        yield pb.GenerateResponse(usage=convert.usage(outcome.final, seq))

    async def _collect(self, flight: Flight, stream: EngineStream, outcome: _Outcome) -> None:
        async with contextlib.aclosing(follow(self._state, flight, stream, None)) as outs:
            async for out in outs:
                outcome.final = out
        self._finished(flight, outcome)

    def _finished(self, flight: Flight, outcome: _Outcome, sample: int = 0) -> pb.Finished:
        assert outcome.final is not None and outcome.final.finished
        reason, stop_string, stop_token_id = convert.finish_reason(
            outcome.final, flight.abort_reason, self._max_model_len, sample
        )
        outcome.finish_reason = pb.FinishReason.Name(reason)
        return pb.Finished(
            sample_index=sample,
            reason=reason,  # type: ignore[arg-type]
            stop_string=stop_string,
            stop_token_id=stop_token_id,
        )

    def _accepted(
        self, flight: Flight, options: pb.ResponseOptions, queue_position: int
    ) -> pb.GenerateResponse:
        accepted = pb.Accepted(
            request_id=flight.request_id,
            prompt_tokens=len(flight.prompt_token_ids),
            seed=flight.params.seed or 0,
            queue_position=queue_position,
        )
        if options.echo_prompt:
            prompt = flight.prompt
            if not isinstance(prompt, str):
                prompt = str(self._tokenizer.decode(prompt, skip_special_tokens=False))
            accepted.prompt_text = prompt
            accepted.prompt_token_ids.extend(flight.prompt_token_ids)
        return pb.GenerateResponse(accepted=accepted)
