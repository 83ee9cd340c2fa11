"""LLM: offline batch generation (vLLM's `LLM` shape)."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from asyncengine.config import EngineArgs
from asyncengine.engine.llm_engine import EngineStats, LLMEngine
from asyncengine.errors import InvalidRequestError
from asyncengine.inputs import ParsedPrompt, PromptType, TokensPrompt, parse_prompt
from asyncengine.lora.request import LoRARequest
from asyncengine.outputs import CompletionOutput, FinishReason, RequestOutput
from asyncengine.sampling_params import SamplingParams

Prompt = str | list[int]
Conversation = Sequence[Mapping[str, Any]]  # chat messages: {"role": ..., "content": ...}


class LLM:
    """Generate for a list of prompts at once: `LLM(model=path).generate(prompts, params)`.

    Any `EngineArgs` field may be passed as a keyword argument; without `model`, the bundled
    default model is used.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        if model is not None:
            engine_args["model"] = model
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(**engine_args))
        self._counter = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        prompt_token_ids: list[int] | Sequence[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is text, token ids, or vLLM's `TextPrompt` / `TokensPrompt` dict; one, or a
        list of any mix. vLLM's older `prompt_token_ids=` keyword gives the ids apart (with
        `prompts`, the texts shown for them). A malformed prompt dict raises
        `InvalidRequestError` before anything runs, and so does a structured-outputs
        constraint that does not compile (as in vLLM); a prompt that cannot run (too long, bad
        token ids) gets an output with `error` set and finish_reason "error", the others are
        unaffected.

        `lora_request` runs every prompt with one LoRA adapter, or each with its own (a list,
        one per prompt; None: the base model). Adapters not registered yet are read first;
        a bad one raises `InvalidRequestError` before anything runs.
        """
        parsed = _parse_prompts(prompts, prompt_token_ids)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(parsed)
        else:
            params_list = list(params)
            if len(params_list) != len(parsed):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(parsed)} prompts"
                )
        loras = _per_prompt(lora_request, len(parsed))
        for lora in loras:
            if lora is not None:
                self.llm_engine.add_lora(lora)
        constraints = {id(p.structured_outputs): p for p in params_list if p.structured_outputs}
        for p in constraints.values():  # compiled once here: the requests find it cached
            self.llm_engine.validator.check_structured_outputs(p)
        results: dict[str, RequestOutput] = {}
        ids = []
        for prompt, p, lora in zip(parsed, params_list, loras):
            request_id = str(next(self._counter))
            ids.append(request_id)
            try:
                self.llm_engine.add_request(
                    request_id, prompt.prompt, p, cache_salt=prompt.cache_salt, lora_request=lora
                )
            except InvalidRequestError as exc:
                results[request_id] = _failed(request_id, prompt.prompt, str(exc))
        self._run(results, show_progress=use_tqdm and sys.stderr.isatty(), total=len(ids))
        outputs = [results[i] for i in ids]
        for output, prompt in zip(outputs, parsed):
            if prompt.text is not None:
                output.prompt = prompt.text
        return outputs

    def _run(self, results: dict[str, RequestOutput], show_progress: bool, total: int) -> None:
        progress = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=total, desc="Processed prompts", initial=len(results))
        while self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (read from disk now); False if it already is."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); they also stop at exit."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer that text prompts are encoded with."""
        return self.llm_engine.tokenizer

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to a list
        of them; outputs come back in order, each with the rendered prompt as `prompt`.

        Each conversation is rendered by the tokenizer's chat template, or by `chat_template`
        (a Jinja template, or the path of a file holding one), with the reply's turn opened
        (`add_generation_prompt`), then encoded without adding special tokens again.
        """
        if not messages:
            raise ValueError("messages is empty: pass a list of {role, content} messages")
        is_single = isinstance(messages[0], Mapping)
        conversations = [messages] if is_single else list(messages)
        template = chat_template
        if template is not None and os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        tokenizer = self.get_tokenizer()
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {tokenizer.name_or_path!r} has no chat template: pass "
                "chat_template=... (a Jinja template), or call generate() with plain prompts"
            )
        texts = [
            tokenizer.apply_chat_template(
                list(conversation),
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request has {len(loras)} entries for {num_prompts} prompts")
    return loras


def _as_list(prompts: Any) -> list[Any]:
    """One prompt (text, ids or a dict) as a list of one; a list of prompts as it is."""
    is_single = isinstance(prompts, str | Mapping) or bool(prompts and isinstance(prompts[0], int))
    return [prompts] if is_single else list(prompts)


def _parse_prompts(
    prompts: PromptType | Sequence[PromptType] | None,
    prompt_token_ids: list[int] | Sequence[list[int]] | None,
) -> list[ParsedPrompt]:
    if prompt_token_ids is None:
        if prompts is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        return [parse_prompt(p) for p in _as_list(prompts)]
    ids_list = _as_list(prompt_token_ids)
    if prompts is None:
        return [parse_prompt(list(ids)) for ids in ids_list]
    texts = _as_list(prompts)
    if len(texts) != len(ids_list):
        raise ValueError(f"{len(texts)} prompts for {len(ids_list)} prompt_token_ids")
    return [
        parse_prompt(TokensPrompt(prompt_token_ids=list(ids), prompt=text))
        for text, ids in zip(texts, ids_list)
    ]


def _failed(request_id: str, prompt: Prompt, error: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=[] if isinstance(prompt, str) else list(prompt),
        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish=FinishReason.REJECTED)],
        finished=True,
        error=error,
    )
