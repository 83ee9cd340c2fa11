"""POST /v1/chat/completions: messages rendered by the chat template, then the same engine path
as completions; whole or as SSE (the role first, the finish reason with the last content)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import Response

from asyncengine.errors import InvalidRequestError
from asyncengine.outputs import CompletionOutput
from asyncengine.sampling_params import RequestOutputKind
from asyncengine.server.call import Call
from asyncengine.server.http import protocol, sse
from asyncengine.server.http.call import (
    HttpContext,
    call_finals,
    call_usage,
    event_stream,
    open_call,
    request_id_of,
)
from asyncengine.server.http.errors import InvalidParamError, UnsupportedParamError
from asyncengine.server.http.fields import check_supported, constraint
from asyncengine.server.http.params import (
    CHAT_PARAMS,
    chat_logprobs,
    finish_reason,
    param_error,
    sampling_params,
)

# apply_chat_template's own arguments, which chat_template_kwargs may not set
_RESERVED_KWARGS = frozenset(
    {"conversation", "chat_template", "add_generation_prompt", "tokenize", "tools", "documents"}
)


async def render_chat(
    ctx: HttpContext,
    messages: list[protocol.ChatMessage],
    add_generation_prompt: bool,
    add_special_tokens: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: the messages rendered by the chat template (transformers'
    `apply_chat_template`, off the event loop, `template_kwargs` its variables), encoded
    without adding special tokens again unless `add_special_tokens` (vLLM's default)."""
    tokenizer = ctx.engine.get_tokenizer()
    template = ctx.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidParamError(
            "messages",
            f"the model {ctx.model_name!r} has no chat template: start the server with "
            "--chat-template PATH, or send plain prompts to /v1/completions",
        )
    if not messages:
        raise InvalidParamError("messages", "at least one message is required")
    max_bytes = ctx.engine.config.scheduler_config.max_prompt_bytes
    conversation = [_message(m, i) for i, m in enumerate(messages)]
    # measured before rendering: the template's work grows with what it is given
    if sum(len(str(m.get("content") or "")) for m in conversation) > max_bytes:
        raise InvalidParamError("messages", f"more than {max_bytes} characters of content")
    kwargs = dict(template_kwargs or {})  # bounded by its JSON bytes (body.py)
    reserved = sorted(_RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise InvalidParamError(f"chat_template_kwargs.{reserved[0]}", "is set by the server")
    try:
        text = await asyncio.to_thread(
            tokenizer.apply_chat_template,
            conversation,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except TemplateError as exc:
        raise InvalidParamError("messages", f"the chat template failed: {exc}") from None
    if len(str(text).encode("utf-8", "surrogatepass")) > max_bytes:
        raise InvalidParamError(
            "messages", f"renders to more than {max_bytes} bytes (max_prompt_bytes)"
        )
    encoded = await ctx.engine.tokenize(str(text), add_special_tokens=add_special_tokens)
    return list(encoded["input_ids"])


def _message(message: protocol.ChatMessage, index: int) -> dict[str, Any]:
    """A message as the template sees it: text content parts joined into one string."""
    rendered = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise UnsupportedParamError(
                    f"messages.{index}.content",
                    f"content parts of type {part.type!r} are not supported (text only)",
                )
            texts.append(part.text)
        rendered["content"] = "".join(texts)
    return rendered


async def create_chat_completion(
    ctx: HttpContext, body: protocol.ChatRequest, request: Request
) -> Response:
    tenant = ctx.authorize(request)
    adapter = ctx.resolve_model(body.model)
    model = ctx.response_model(adapter)
    if body.tools:
        raise UnsupportedParamError("tools", "tool calling is not supported")
    check_supported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidParamError("top_logprobs", "needs logprobs: true")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    constrained = constraint(body)
    table = {**CHAT_PARAMS, **constrained.names}
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None:  # OpenAI's newer name wins
        max_tokens = body.max_completion_tokens
        table["max_tokens"] = "max_completion_tokens"
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    try:
        params = sampling_params(body, max_tokens, num_top, kind, constrained.params)
    except InvalidRequestError as exc:
        raise param_error(exc, table) from None
    prompt = await render_chat(
        ctx,
        body.messages,
        body.add_generation_prompt,
        body.add_special_tokens,
        body.chat_template_kwargs,
    )
    request_id, response_id = request_id_of(request, "chatcmpl")
    call = await open_call(
        ctx, request_id, tenant, table, [prompt], params, body.priority, body.cache_salt, adapter
    )
    created = int(time.time())
    headers = {"x-request-id": request_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _Chunks(response_id, created, model, include_usage)
        return event_stream(ctx, call, _events(ctx, call, chunks, params.n, num_top), headers)
    finals = await call_finals(call, request)
    if finals is None:
        return Response(status_code=499)  # nobody reads it; the request is aborted
    choices = [await _choice(ctx, completion, num_top) for completion in finals[0].outputs]
    response = protocol.ChatCompletion(
        id=response_id,
        created=created,
        model=model,
        choices=choices,
        usage=call_usage(call),
    )
    return Response(response.model_dump_json(), media_type="application/json", headers=headers)


async def _choice(
    ctx: HttpContext, completion: CompletionOutput, num_top: int | None
) -> protocol.ChatChoice:
    """One choice of a whole (not streamed) response."""
    logprobs = None
    if num_top is not None:
        entries = completion.logprobs or []
        logprobs = await chat_logprobs(ctx.texts, completion.token_ids, entries, num_top)
    return protocol.ChatChoice(
        index=completion.index,
        message=protocol.ChatMessageOut(content=completion.text),
        logprobs=logprobs,
        finish_reason=finish_reason(completion.finish),
        stop_reason=completion.stop_reason,
    )


class _Chunks:
    """Frames of one streamed chat completion."""

    def __init__(self, response_id: str, created: int, model: str, include_usage: bool):
        self._id, self._created, self._model = response_id, created, model
        self.include_usage = include_usage

    def frame(
        self, choices: list[protocol.ChatChunkChoice], usage: protocol.Usage | None = None
    ) -> str:
        chunk = protocol.ChatCompletionChunk(
            id=self._id,
            created=self._created,
            model=self._model,
            choices=choices,
            usage=usage,
        )
        return sse.event(chunk, self.include_usage)


async def _events(
    ctx: HttpContext, call: Call, chunks: _Chunks, num_samples: int, num_top: int | None
) -> AsyncGenerator[str, None]:
    heartbeat_s = ctx.state.options.heartbeat_interval
    is_started = False
    try:
        while not call.is_done:
            ready = await call.next_outputs(heartbeat_s)
            if not ready:
                yield sse.KEEPALIVE
                continue
            if not is_started:  # each sample's role first, with the first tokens, as vLLM
                is_started = True  # sends it: a client times its first token by this chunk
                for index in range(num_samples):
                    delta = protocol.ChatDelta(role="assistant", content="")
                    yield chunks.frame([protocol.ChatChunkChoice(index=index, delta=delta)])
            for _, out in ready:
                for completion in out.outputs:
                    choice = await _delta_choice(ctx, completion, num_top)
                    if choice is not None:
                        yield chunks.frame([choice])
        if chunks.include_usage:
            yield chunks.frame([], call_usage(call))
    except Exception as exc:
        call.fail(exc)
        yield sse.error_event(exc)
    yield sse.DONE


async def _delta_choice(
    ctx: HttpContext, completion: CompletionOutput, num_top: int | None
) -> protocol.ChatChunkChoice | None:
    """One sample's new content, with its finish reason when it is the last."""
    finish = completion.finish
    # tokens whose character is still incomplete are a chunk with no text, as vLLM streams them
    if not completion.text and not completion.token_ids and finish is None:
        return None
    logprobs = None
    if num_top is not None and completion.logprobs:
        logprobs = await chat_logprobs(
            ctx.texts, completion.token_ids, completion.logprobs, num_top
        )
    return protocol.ChatChunkChoice(
        index=completion.index,
        delta=protocol.ChatDelta(content=completion.text),
        logprobs=logprobs,
        finish_reason=finish_reason(finish),
        stop_reason=completion.stop_reason,
    )
