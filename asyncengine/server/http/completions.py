"""POST /v1/completions: prompts (text or token ids, one or many) to the engine and back, whole
or as SSE; `echo` with `logprobs` scores the prompt (lm-eval's loglikelihood requests)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import CompletionOutput, Logprobs, RequestOutput
from asyncengine.sampling_params import RequestOutputKind
from asyncengine.server.call import Call
from asyncengine.server.http import protocol, sse
from asyncengine.server.http.call import (
    HttpContext,
    call_finals,
    call_usage,
    check_prompt_list,
    event_stream,
    open_call,
    request_id_of,
)
from asyncengine.server.http.errors import UnsupportedParamError
from asyncengine.server.http.fields import check_supported, constraint
from asyncengine.server.http.params import (
    COMPLETION_PARAMS,
    completion_logprobs,
    finish_reason,
    param_error,
    sampling_params,
)


@dataclass
class _Plan:
    """What the response holds beside the engine's outputs."""

    response_id: str
    created: int
    model: str  # what the response says it came from: the served model or the adapter
    num_samples: int
    num_top: int | None  # logprobs=k
    echo: bool
    is_echo_only: bool  # echo with max_tokens 0: the prompt alone, nothing generated
    skip_special_tokens: bool
    texts: list[str | None]  # per prompt: its text as given (None: token ids)
    # per choice of a stream: whether the prompt went out yet, and the text sent so far
    echoed: set[int] = field(default_factory=set)
    offsets: dict[int, int] = field(default_factory=dict)
    # per prompt: its scores, which come once, in its first output
    prompt_logprobs: dict[int, list[Logprobs | None]] = field(default_factory=dict)


async def create_completion(
    ctx: HttpContext, body: protocol.CompletionRequest, request: Request
) -> Response:
    tenant = ctx.authorize(request)
    adapter = ctx.resolve_model(body.model)
    if body.suffix:
        raise UnsupportedParamError("suffix", "is not supported")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise UnsupportedParamError("best_of", "is supported only equal to n")
    check_supported(body)
    constrained = constraint(body)
    table = {**COMPLETION_PARAMS, **constrained.names}
    prompts = check_prompt_list(body.prompt, "prompt")
    echo = bool(body.echo)
    is_echo_only = echo and body.max_tokens == 0
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    try:
        params = sampling_params(
            body,
            # the prompt is scored by the step that samples its first token: one is made,
            # and dropped (vLLM's way with echo and max_tokens 0)
            1 if is_echo_only else body.max_tokens,
            body.logprobs,
            kind,
            constrained.params,
            prompt_logprobs=body.logprobs if echo else None,
        )
    except InvalidRequestError as exc:
        raise param_error(exc, table) from None
    request_id, response_id = request_id_of(request, "cmpl")
    texts = [p if isinstance(p, str) else None for p in prompts]
    plan = _Plan(
        response_id,
        int(time.time()),
        ctx.response_model(adapter),
        params.n,
        body.logprobs,
        echo,
        is_echo_only,
        body.skip_special_tokens,
        texts,
    )
    if not body.add_special_tokens:
        prompts = await _encoded_as_they_are(ctx, prompts)
    call = await open_call(
        ctx, request_id, tenant, table, prompts, params, body.priority, body.cache_salt, adapter
    )
    headers = {"x-request-id": request_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(ctx, call, _events(ctx, call, plan, include_usage), headers)
    finals = await call_finals(call, request)
    if finals is None:
        return Response(status_code=499)  # nobody reads it; the requests are aborted
    choices = []
    for prompt_index, (final, stream) in enumerate(zip(finals, call.streams)):
        text = plan.texts[prompt_index]
        prompt_text = await _prompt_text(ctx, text, stream.prompt_token_ids, echo)
        for completion in final.outputs:
            index = prompt_index * plan.num_samples + completion.index
            choices.append(await _choice(ctx, plan, index, final, completion, prompt_text))
    response = protocol.Completion(
        id=response_id,
        created=plan.created,
        model=plan.model,
        choices=choices,
        usage=call_usage(call, 0 if is_echo_only else None),
    )
    return Response(response.model_dump_json(), media_type="application/json", headers=headers)


async def _encoded_as_they_are(
    ctx: HttpContext, prompts: list[str | list[int]]
) -> list[str | list[int]]:
    """Text prompts as token ids without the special tokens the tokenizer would add
    (`add_special_tokens: false`); token ids stay as given. Each text is bounded first."""
    encoded: list[str | list[int]] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            try:
                ids = await ctx.engine.tokenize(prompt, add_special_tokens=False)
            except InvalidRequestError as exc:
                prefix = f"prompt[{index}]:" if len(prompts) > 1 else ""
                raise param_error(exc, {"text": "prompt"}, prefix) from None
            prompt = list(ids["input_ids"])
        encoded.append(prompt)
    return encoded


async def _prompt_text(ctx: HttpContext, text: str | None, token_ids: list[int], echo: bool) -> str:
    if not echo:
        return ""
    if text is not None:
        return text
    return await ctx.engine.detokenize(token_ids, skip_special_tokens=False)


async def _choice(
    ctx: HttpContext,
    plan: _Plan,
    index: int,
    final: RequestOutput,
    completion: CompletionOutput,
    prompt_text: str,
) -> protocol.CompletionChoice:
    """One choice of a whole (not streamed) response."""
    token_ids: list[int] = []
    entries: list[Logprobs | None] = []
    hidden: list[bool] = []
    if plan.echo:
        token_ids += final.prompt_token_ids
        entries += final.prompt_logprobs or [None] * len(final.prompt_token_ids)
        hidden += await ctx.texts.hidden_in(prompt_text, final.prompt_token_ids)
    text = prompt_text
    if not plan.is_echo_only:
        text += completion.text
        token_ids += completion.token_ids
        entries += completion.logprobs or []
        hidden += ctx.texts.skipped(completion.token_ids, plan.skip_special_tokens)
    logprobs = None
    if plan.num_top is not None:
        logprobs = await completion_logprobs(ctx.texts, token_ids, entries, plan.num_top, 0, hidden)
    return protocol.CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason="length" if plan.is_echo_only else finish_reason(completion.finish),
        stop_reason=None if plan.is_echo_only else completion.stop_reason,
    )


async def _events(
    ctx: HttpContext, call: Call, plan: _Plan, include_usage: bool
) -> AsyncGenerator[str, None]:
    """The SSE frames of a streamed completion: a chunk per choice per output, the usage
    chunk when asked for, then [DONE]; a failure midway is an error frame before [DONE]."""
    heartbeat_s = ctx.state.options.heartbeat_interval
    try:
        while not call.is_done:
            ready = await call.next_outputs(heartbeat_s)
            if not ready:
                yield sse.KEEPALIVE
            for prompt_index, out in ready:
                if out.prompt_logprobs is not None:
                    plan.prompt_logprobs[prompt_index] = out.prompt_logprobs
                for completion in out.outputs:
                    choice = await _delta_choice(ctx, plan, prompt_index, out, completion)
                    if choice is None:
                        continue
                    chunk = protocol.Completion(
                        id=plan.response_id,
                        created=plan.created,
                        model=plan.model,
                        choices=[choice],
                        usage=None,
                    )
                    yield sse.event(chunk, include_usage)
        if include_usage:
            chunk = protocol.Completion(
                id=plan.response_id,
                created=plan.created,
                model=plan.model,
                choices=[],
                usage=call_usage(call, 0 if plan.is_echo_only else None),
            )
            yield sse.event(chunk, include_usage)
    except Exception as exc:
        call.fail(exc)
        yield sse.error_event(exc)
    yield sse.DONE


async def _delta_choice(
    ctx: HttpContext,
    plan: _Plan,
    prompt_index: int,
    out: RequestOutput,
    completion: CompletionOutput,
) -> protocol.CompletionChoice | None:
    """The chunk of one choice for one DELTA output; None when it has nothing to say."""
    index = prompt_index * plan.num_samples + completion.index
    text = ""
    token_ids: list[int] = []
    entries: list[Logprobs | None] = []
    hidden: list[bool] = []
    if plan.echo and index not in plan.echoed:
        plan.echoed.add(index)
        given = plan.texts[prompt_index]
        prompt = await _prompt_text(ctx, given, out.prompt_token_ids, True)
        text, token_ids = prompt, list(out.prompt_token_ids)
        scores = plan.prompt_logprobs.get(prompt_index)
        entries = list(scores or [None] * len(token_ids))
        if plan.num_top is not None:
            hidden = await ctx.texts.hidden_in(prompt, token_ids)
    if not plan.is_echo_only:
        text += completion.text
        token_ids += completion.token_ids
        entries += completion.logprobs or []
        hidden += ctx.texts.skipped(completion.token_ids, plan.skip_special_tokens)
    finish = completion.finish
    # tokens whose character is still incomplete are a chunk with no text, as vLLM streams
    # them: a client times its first token, and counts tokens, by the chunks
    if not text and not token_ids and finish is None:
        return None
    logprobs = None
    if plan.num_top is not None:
        offset = plan.offsets.get(index, 0)
        logprobs = await completion_logprobs(
            ctx.texts, token_ids, entries, plan.num_top, offset, hidden
        )
        shown = (t for t, is_hidden in zip(logprobs.tokens, hidden) if not is_hidden)
        plan.offsets[index] = offset + sum(len(token) for token in shown)
    if plan.is_echo_only and finish is not None:
        return protocol.CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason="length"
        )
    return protocol.CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=finish_reason(finish),
        stop_reason=completion.stop_reason,
    )
