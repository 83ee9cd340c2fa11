"""Translation between the .proto messages and the engine's types (no gRPC calls here)."""

from __future__ import annotations

import secrets
from typing import Any

from asyncengine.engine.llm_engine import EngineStats
from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import CompletionOutput, Logprobs, RequestOutput
from asyncengine.outputs import FinishReason as EngineFinish
from asyncengine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from asyncengine.server.abort_reason import AbortReason
from asyncengine.server.errors import InvalidFieldError
from asyncengine.v1 import control_pb2, generation_pb2

FinishReason = generation_pb2.FinishReason
Phase = generation_pb2.Heartbeat.Phase

# the engine's field -> the request field it comes from, for errors that name the field
# ("prompt" is the oneof member the request used: text or token_ids)
_PROTO_FIELDS = {
    "request_id": "request_id",
    "cache_salt": "cache_salt",
    "n": "sampling.n",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "seed": "sampling.seed",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "max_tokens": "stopping.max_new_tokens",
    "min_tokens": "stopping.min_new_tokens",
    "stop": "stopping.stop",
    "stop_token_ids": "stopping.stop_token_ids",
    "ignore_eos": "stopping.ignore_eos",
    "include_stop_str_in_output": "stopping.include_stop_string",
    "logprobs": "response.logprobs",
    "skip_special_tokens": "response.skip_special_tokens",
    "structured_outputs": "constraint",
    "structured_outputs.json": "json_schema",
    "structured_outputs.json_object": "json_object",
    "structured_outputs.regex": "regex",
    "structured_outputs.grammar": "grammar",
    "structured_outputs.choice": "choice.choices",
}
_FINISH_REASONS = {
    EngineFinish.EOS: FinishReason.EOS,
    EngineFinish.STOP_STRING: FinishReason.STOP_STRING,
    EngineFinish.STOP_TOKEN: FinishReason.STOP_TOKEN,
    EngineFinish.LENGTH: FinishReason.LENGTH,
    EngineFinish.CONTEXT_LIMIT: FinishReason.CONTEXT_LIMIT,
    EngineFinish.CACHE_LIMIT: FinishReason.CACHE_LIMIT,
}
# why the server aborted a request -> its proto reason; the mapping exists here only
_ABORT_REASONS = {
    AbortReason.CANCELLED: FinishReason.CANCELLED,
    AbortReason.TIME_LIMIT: FinishReason.TIME_LIMIT,
    AbortReason.ABORTED_BY_SERVER: FinishReason.ABORTED_BY_SERVER,
}
_PHASES: dict[str, generation_pb2.Heartbeat.Phase] = {
    "queued": Phase.QUEUED,
    "prefill": Phase.PREFILL,
    "decode": Phase.DECODE,
    "preempted": Phase.PREEMPTED,
}


def prompt_of(request: Any, prefix: str = "") -> tuple[str | list[int], str]:
    """The prompt of a GenerateRequest or Prompt (text or token ids) and its field name."""
    kind = request.WhichOneof("prompt" if hasattr(request, "request_id") else "kind")
    if kind == "text":
        return request.text, prefix + "text"
    if kind == "token_ids":
        # as it is: the engine bounds its length before copying or scanning it
        return request.token_ids.ids, prefix + "token_ids"
    raise InvalidFieldError(prefix + "text", "a prompt (text or token_ids) is required")


def field_error(exc: InvalidRequestError, prompt_field: str) -> InvalidFieldError:
    """The engine's error named by the request field it came from (`stopping.stop`, ...);
    `prompt_field` is the prompt's (`text`, `token_ids`, `prompts[2].text`)."""
    if isinstance(exc, InvalidFieldError):
        return exc
    is_prompt = exc.field in ("prompt", "text", "token_ids")  # what a call's one input is
    name = prompt_field if is_prompt else _PROTO_FIELDS.get(exc.field, exc.field)
    error = InvalidFieldError(name, exc.description)
    error.__cause__ = exc
    return error


def structured_outputs(request: Any) -> StructuredOutputsParams | None:
    """The `constraint` of a GenerateRequest or GenerateBatchRequest; None when unset.

    A bad value raises the engine's `InvalidRequestError`; `field_error` names the field.
    """
    kind = request.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object" and not request.json_object:
        raise InvalidFieldError("json_object", "must be true when set (unset it for none)")
    if kind == "choice":
        # as it is: StructuredOutputsParams bounds its length before copying
        return StructuredOutputsParams(choice=request.choice.choices)
    engine_field = "json" if kind == "json_schema" else kind
    return StructuredOutputsParams(
        **{engine_field: getattr(request, kind)},
        disable_any_whitespace=request.disable_any_whitespace,
    )


def sampling_params(
    sampling: generation_pb2.SamplingOptions,
    stopping: generation_pb2.StoppingOptions,
    response: generation_pb2.ResponseOptions,
    output_kind: RequestOutputKind,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams of a request; picks a seed for random sampling when none is given.

    A bad value raises the engine's `InvalidRequestError`; `field_error` names the field.
    """
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    seed = sampling.seed if sampling.HasField("seed") else None
    if seed is None and temperature > 0:
        seed = secrets.randbits(63)  # reported in Accepted so the client can replay it
    return SamplingParams(
        n=sampling.n or 1,
        temperature=temperature,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=seed,
        repetition_penalty=(
            sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0
        ),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        max_tokens=stopping.max_new_tokens if stopping.HasField("max_new_tokens") else None,
        min_tokens=stopping.min_new_tokens,
        # the repeated fields go as they are: SamplingParams bounds their length before copying
        stop=stopping.stop,
        stop_token_ids=stopping.stop_token_ids,
        ignore_eos=stopping.ignore_eos,
        include_stop_str_in_output=stopping.include_stop_string,
        logprobs=response.logprobs if response.HasField("logprobs") else None,
        skip_special_tokens=(
            response.skip_special_tokens if response.HasField("skip_special_tokens") else True
        ),
        output_kind=output_kind,
        structured_outputs=constraint,
    )


def finish_reason(
    completion: CompletionOutput, abort_reason: AbortReason | None
) -> tuple[int, str, int | None]:
    """(FinishReason, matched stop string, matched stop token id) of a finished sample;
    `abort_reason` says why the server aborted it (None: not the server, or not aborted)."""
    finish, stop = completion.finish, completion.stop_reason
    assert finish is not None, "the sample has not finished"
    if finish is EngineFinish.ABORTED:
        if abort_reason is None:
            return FinishReason.ABORTED_BY_SERVER, "", None
        return _ABORT_REASONS[abort_reason], "", None
    reason = _FINISH_REASONS[finish]
    if finish is EngineFinish.STOP_STRING:
        return reason, str(stop), None
    if finish is EngineFinish.STOP_TOKEN:
        return reason, "", int(stop)  # type: ignore[arg-type]
    if finish is EngineFinish.EOS:
        return reason, "", completion.token_ids[-1] if completion.token_ids else None
    return reason, "", None


def usage(out: RequestOutput, sequence_number: int = 0) -> generation_pb2.Usage:
    """Token counts and timings of a request from its last output."""
    metrics = out.metrics
    msg = generation_pb2.Usage(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in out.outputs),
        sequence_number=sequence_number,
    )
    if metrics is None:
        return msg
    msg.cached_tokens = metrics.num_cached_tokens
    msg.preemptions = metrics.num_preemptions
    end = metrics.finished_time
    if metrics.first_scheduled_time is not None:
        msg.queue_time_s = metrics.first_scheduled_time - metrics.arrival_time
    if metrics.first_token_time is not None:
        msg.time_to_first_token_s = metrics.first_token_time - metrics.arrival_time
        if end is not None:
            msg.decode_time_s = end - metrics.first_token_time
    return msg


def logprobs(
    entries: list[Logprobs], token_ids: list[int], num_top: int, tokenizer: Any
) -> list[generation_pb2.TokenLogprobs]:
    """One TokenLogprobs per position: the sampled token's logprob and the top `num_top`."""
    result = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted(
            ((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: kv[1], reverse=True
        )[:num_top]
        ids = [token_id] + [t for t, _ in ranked]
        names = tokenizer.convert_ids_to_tokens(ids)
        top = [
            generation_pb2.TokenLogprob(token_id=t, logprob=lp, token=name)
            for (t, lp), name in zip(ranked, names[1:])
        ]
        sampled = generation_pb2.TokenLogprob(
            token_id=token_id,
            logprob=entry[token_id].logprob if token_id in entry else float("nan"),
            token=names[0],
        )
        result.append(generation_pb2.TokenLogprobs(sampled=sampled, top=top))
    return result


def generate_result(
    request_id: str,
    final: RequestOutput,
    finished: generation_pb2.Finished,
    options: generation_pb2.ResponseOptions,
    tokenizer: Any,
) -> generation_pb2.GenerateResult:
    """One prompt's result of a unary Generate, from its final output; `request_id` is the
    caller's (the output's is the engine's, scoped by tenant)."""
    completion = final.outputs[0]
    result = generation_pb2.GenerateResult(
        request_id=request_id,
        text=completion.text,
        finish_reason=finished.reason,
        stop_string=finished.stop_string,
        usage=usage(final),
    )
    if finished.HasField("stop_token_id"):
        result.stop_token_id = finished.stop_token_id
    if options.return_token_ids:
        result.token_ids.extend(completion.token_ids)
    if options.HasField("logprobs") and completion.logprobs is not None:
        result.logprobs.extend(
            logprobs(completion.logprobs, completion.token_ids, options.logprobs, tokenizer)
        )
    return result


def phase(name: str | None) -> generation_pb2.Heartbeat.Phase:
    return _PHASES.get(name or "", Phase.PHASE_UNSPECIFIED)


def load_report(stats: EngineStats, num_admitted: int) -> control_pb2.LoadReport:
    return control_pb2.LoadReport(
        admitted=num_admitted,
        running=stats.num_running,
        waiting=stats.num_waiting,
        swapped=stats.num_swapped,
        gpu_blocks_total=stats.num_gpu_blocks,
        gpu_blocks_free=stats.num_free_gpu_blocks,
        cpu_blocks_total=stats.num_cpu_blocks,
        cpu_blocks_free=stats.num_free_cpu_blocks,
        block_usage_ratio=stats.gpu_block_usage,
        cpu_block_usage_ratio=stats.cpu_block_usage,
        preemptions_swap=stats.num_preemptions_swap,
        preemptions_recompute=stats.num_preemptions_recompute,
    )
