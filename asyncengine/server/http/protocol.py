"""The OpenAI wire format as pydantic models: what requests may carry and what responses hold.

Requests are typed loosely on purpose (a number is a number, a range is not checked here):
the engine checks every value once and names the field, and `params.py` translates the name.
No field passes in silence: each one declared here is honoured, or refused (`unsupported`:
any value but the one that asks for nothing is a 400 naming it); any other is logged once
as ignored (`fields.py`), whether vLLM takes it (`ignored`) or nobody does.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

TokenIds = list[int]


class Lenient(BaseModel):
    """A request body: fields not declared are left out (and logged by fields.py)."""

    model_config = ConfigDict(extra="ignore")

    endpoint: ClassVar[str] = ""  # the route, as the log of ignored fields names it
    # vLLM's fields this server takes and deliberately does nothing with (logged once each)
    ignored: ClassVar[frozenset[str]] = frozenset()
    unsupported: ClassVar[dict[str, object]] = {}
    # the top-level fields of the body that no field here declares (set by body.decode)
    _undeclared: list[str] = PrivateAttr(default_factory=list)

    @property
    def undeclared(self) -> list[str]:
        return self._undeclared


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: refused when true (params.check_supported)


class _SamplingFields(Lenient):
    """What completions and chat both take: OpenAI's fields, then vLLM's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens (-1: the context)
    allowed_token_ids: list[int] | None = None  # sample only these
    # a constraint on the output: OpenAI's response_format, vLLM's structured_outputs, or
    # vLLM's older guided_* fields (fields.py: at most one of them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's fields this server refuses unless they ask for nothing (`unsupported`)
    use_beam_search: Any = None
    length_penalty: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    ignored: ClassVar[frozenset[str]] = frozenset(
        {
            "user",  # OpenAI's end-user id: nothing here is per user
            "request_id",  # the x-request-id header names a request here
            "mm_processor_kwargs",  # text-only models
        }
    )
    # a field's value that asks for nothing (None, [] and {} do too); any other is refused
    unsupported: ClassVar[dict[str, object]] = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "bad_words": None,
        "logits_processors": None,
        "spaces_between_special_tokens": True,
        "prompt_logprobs": None,
        "return_tokens_as_token_ids": False,
        "return_token_ids": False,
        "structural_tag": None,
        "guided_whitespace_pattern": None,
        "kv_transfer_params": None,
        "vllm_xargs": None,
    }


class CompletionRequest(_SamplingFields):
    endpoint: ClassVar[str] = "/v1/completions"

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's: BOS (or what the tokenizer adds) before a text prompt; token ids stay as given
    add_special_tokens: bool = True
    prompt_embeds: Any = None
    unsupported: ClassVar[dict[str, object]] = {
        **_SamplingFields.unsupported,
        "prompt_embeds": None,
    }


class ContentPart(Lenient):
    type: str
    text: str | None = None


class ChatMessage(Lenient):
    model_config = ConfigDict(extra="allow")  # tool calls, names: the template may use them

    # OpenAI's roles: another is a 400 naming `messages.N.role`, not a prompt the template mangles
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_SamplingFields):
    endpoint: ClassVar[str] = "/v1/chat/completions"
    ignored: ClassVar[frozenset[str]] = _SamplingFields.ignored | {
        "parallel_tool_calls",  # no tools here (`tools` is refused)
        "reasoning_effort",
        "include_reasoning",
    }

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: special tokens encoded on top of the template's text (which has its own BOS)
    add_special_tokens: bool = False
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    echo: Any = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None  # a template from the caller: only --chat-template's is run
    unsupported: ClassVar[dict[str, object]] = {
        **_SamplingFields.unsupported,
        "tool_choice": "none",
        "functions": None,
        "function_call": None,
        "echo": False,
        "continue_final_message": False,
        "documents": None,
        "chat_template": None,
    }


class TokenizeRequest(Lenient):
    endpoint: ClassVar[str] = "/tokenize"

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    endpoint: ClassVar[str] = "/detokenize"

    model: str | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(Lenient):
    endpoint: ClassVar[str] = "/v1/load_lora_adapter"

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(Lenient):
    endpoint: ClassVar[str] = "/v1/unload_lora_adapter"

    lora_name: str


# -- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that matched


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asyncengine"
    root: str  # the model's path; an adapter's directory
    parent: str | None = None  # an adapter's base model (its id in this list)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
