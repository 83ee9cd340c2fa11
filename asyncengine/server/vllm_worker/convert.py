"""Translation between SMG's vLLM worker protocol (`vllm.grpc.engine`, PyPI smg-grpc-proto) and
the engine's types; no gRPC calls here.

proto3 has no "unset" for plain scalars: a gateway that leaves `top_p`, `n` or
`repetition_penalty` out sends 0, which here means the engine's default, never the value 0.
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto import vllm_engine_pb2 as pb

from asyncengine.engine.load import LoadReport
from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import CompletionOutput, Logprobs, RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from asyncengine.server.errors import InvalidFieldError

_PARAMS = "sampling_params."
# the engine's field -> this protocol's, for errors that name the field
_FIELDS = {
    name: _PARAMS + name
    for name in (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "max_tokens", "min_tokens", "stop",
        "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs",
        "prompt_logprobs", "skip_special_tokens", "logit_bias",
    )
}  # fmt: skip
_FIELDS |= {
    "structured_outputs": _PARAMS + "constraint",
    "structured_outputs.json": _PARAMS + "json_schema",
    "structured_outputs.json_object": _PARAMS + "json_object",
    "structured_outputs.regex": _PARAMS + "regex",
    "structured_outputs.grammar": _PARAMS + "grammar",
    "structured_outputs.choice": _PARAMS + "choice.choices",
}
# what this engine does not do: refused by name, never ignored
_UNSUPPORTED_INPUTS = ("mm_inputs", "media_refs", "kv_transfer_params")


def field_error(exc: InvalidRequestError, prompt_field: str) -> InvalidFieldError:
    """The engine's error named by this protocol's field (`sampling_params.top_p`)."""
    if isinstance(exc, InvalidFieldError):
        return exc
    is_prompt = exc.field in ("prompt", "text", "token_ids")
    name = prompt_field if is_prompt else _FIELDS.get(exc.field, exc.field)
    error = InvalidFieldError(name, exc.description)
    error.__cause__ = exc
    return error


def prompt_of(request: pb.GenerateRequest) -> tuple[str | Any, str]:
    """The prompt (text, or token ids as sent) and its field name; refuses what is not served."""
    for name in _UNSUPPORTED_INPUTS:
        if request.HasField(name):
            raise InvalidFieldError(name, "is not supported by this engine (text models only)")
    if request.extra_mm_inputs:
        raise InvalidFieldError("extra_mm_inputs", "is not supported by this engine")
    if request.HasField("kv_transfer_params_json"):
        raise InvalidFieldError("kv_transfer_params_json", "KV transfer is not supported")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidFieldError("data_parallel_rank", "this engine has one rank, 0")
    kind = request.WhichOneof("input")
    if kind == "text":
        return request.text, "text"
    if kind == "tokenized":
        return request.tokenized.input_ids, "tokenized.input_ids"
    raise InvalidFieldError("tokenized", "a prompt (tokenized or text) is required")


def truncated(prompt: str | Any, params: pb.SamplingParams) -> str | Any:
    """The prompt's last `truncate_prompt_tokens` ids (-1 or unset: all of it)."""
    if not params.HasField("truncate_prompt_tokens") or params.truncate_prompt_tokens == -1:
        return prompt
    keep = params.truncate_prompt_tokens
    name = _PARAMS + "truncate_prompt_tokens"
    if keep < 1:
        raise InvalidFieldError(name, f"must be -1 or >= 1, got {keep}")
    if isinstance(prompt, str):
        raise InvalidFieldError(name, "applies to tokenized prompts only")
    return prompt[-keep:] if len(prompt) > keep else prompt


def constraint(params: pb.SamplingParams) -> StructuredOutputsParams | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "structural_tag":
        raise InvalidFieldError(
            _PARAMS + "structural_tag",
            "is not supported; use json_schema, regex, grammar, choice or json_object",
        )
    if kind == "json_object" and not params.json_object:
        raise InvalidFieldError(_PARAMS + "json_object", "must be true when set")
    if kind == "choice":
        return StructuredOutputsParams(choice=params.choice.choices)
    if kind == "json_schema":
        return StructuredOutputsParams(json=params.json_schema)
    return StructuredOutputsParams(**{kind: getattr(params, kind)})


def _num_logprobs(params: pb.SamplingParams, name: str) -> int | None:
    if not params.HasField(name):
        return None
    value = getattr(params, name)
    if value < 0:  # vLLM's -1: every token of the vocabulary
        raise InvalidFieldError(
            _PARAMS + name, f"must be in [0, 20] (-1, all, is not served), got {value}"
        )
    return int(value)


def sampling_params(params: pb.SamplingParams, is_stream: bool) -> SamplingParams:
    """The engine's SamplingParams; 0 in a plain proto3 scalar is the engine's default."""
    return SamplingParams(
        n=params.n or 1,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed if params.HasField("seed") else None,
        repetition_penalty=params.repetition_penalty or 1.0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        min_tokens=params.min_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logprobs=_num_logprobs(params, "logprobs"),
        prompt_logprobs=_num_logprobs(params, "prompt_logprobs"),
        # the gateway detokenizes itself; this only shapes the text stop strings match
        skip_special_tokens=params.skip_special_tokens,
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        output_kind=RequestOutputKind.DELTA if is_stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=constraint(params),
    )


def _top(entry: Logprobs | None, num_top: int) -> pb.TopLogProbs:
    top = pb.TopLogProbs()
    if entry and num_top:
        ranked = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_top]
        top.token_ids.extend(t for t, _ in ranked)
        top.values.extend(lp.logprob for _, lp in ranked)
    return top


def output_logprobs(completion: CompletionOutput, num_top: int | None) -> pb.OutputLogProbs | None:
    if num_top is None or not completion.logprobs:
        return None
    msg = pb.OutputLogProbs()
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        msg.token_ids.append(token_id)
        msg.token_logprobs.append(entry[token_id].logprob if token_id in entry else float("nan"))
        msg.top_logprobs.append(_top(entry, num_top))
    return msg


def input_logprobs(out: RequestOutput, num_top: int | None) -> pb.InputLogProbs | None:
    if num_top is None or out.prompt_logprobs is None:
        return None
    msg = pb.InputLogProbs()
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
        value = pb.InputTokenLogProb()
        if entry is not None and token_id in entry:
            value.value = entry[token_id].logprob
        msg.token_logprobs.append(value)
        msg.token_ids.append(token_id)
        msg.top_logprobs.append(_top(entry, num_top))
    return msg


def cached_tokens(out: RequestOutput) -> int:
    return out.metrics.num_cached_tokens if out.metrics is not None else 0


def complete(
    out: RequestOutput,
    completion: CompletionOutput,
    num_tokens: int,
    num_logprobs: int | None,
    num_prompt_logprobs: int | None,
) -> pb.GenerateComplete:
    """A finished sample. `completion` carries what was not yet sent in a chunk (streaming:
    the last delta, as vLLM's servicer sends it; otherwise everything); `num_tokens` is the
    sample's whole count."""
    msg = pb.GenerateComplete(
        output_ids=completion.token_ids,
        finish_reason=completion.finish_reason or "stop",
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=num_tokens,
        cached_tokens=cached_tokens(out),
        index=completion.index,
        output_logprobs=output_logprobs(completion, num_logprobs),
        input_logprobs=input_logprobs(out, num_prompt_logprobs),
    )
    stop = completion.stop_reason
    if isinstance(stop, str):
        msg.matched_stop_str = stop
    elif isinstance(stop, int):
        msg.matched_token_id = stop
    return msg


def scheduler_load(load: LoadReport) -> pb.SchedulerLoad:
    return pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=load.num_running,
        num_waiting_reqs=load.num_waiting + load.num_swapped,
        num_total_reqs=load.num_running + load.num_waiting + load.num_swapped,
        num_used_tokens=load.num_used_tokens,
        max_total_num_tokens=load.num_total_tokens,
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        cache_hit_rate=load.cache_hit_rate,
        utilization=load.num_running / load.max_running_requests,
        max_running_requests=load.max_running_requests,
        num_waiting_uncached_tokens=load.num_waiting_uncached_tokens,
    )
