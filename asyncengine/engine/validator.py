"""The one check of every request at the engine's boundary, before any work is done for it.

Each bound is measured by size or count first, so no caller can make the check itself slow.
Every failure is an `InvalidRequestError` naming the engine's field (`prompt`, `request_id`,
`stop_token_ids`, ...); front ends translate the name, never the message. `SamplingParams`
checks its own values on construction; what depends on the model and the cache is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asyncengine.config import EngineConfig
from asyncengine.engine.structured_output import (
    CompiledConstraint,
    GrammarError,
    StructuredOutputManager,
)
from asyncengine.errors import ContextLengthError, InvalidRequestError
from asyncengine.lora.request import LoRARequest
from asyncengine.sampling_params import MAX_INT, SamplingParams, StructuredOutputsParams, shown

MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 256
_MAX_UTF8_BYTES_PER_CHAR = 4
_INT_TYPES = {int, bool}  # what isinstance(t, int) holds for, without the subclasses


def check_request_id(request_id: str) -> None:
    """A request id is a non-empty string of at most MAX_REQUEST_ID_LEN characters (the
    engine's ids, and the server's callers' ids before they are scoped by tenant)."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_LEN} characters")


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed every check, tokenized: the only thing the engine queues."""

    request_id: str
    prompt: str | None  # the text, when the caller sent text
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    cache_salt: str | None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class RequestValidator:
    """Checks requests against one engine's vocabulary, context length and cache."""

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        num_gpu_blocks: int,
        grammars: StructuredOutputManager | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.grammars = grammars  # compiles structured-outputs constraints; None: refused
        self.max_model_len = config.model_config.max_model_len
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_prompt_bytes = config.scheduler_config.max_prompt_bytes
        # a prompt is allocated whole, sliding window or not: it must fit the cache at once
        self.cache_capacity = num_gpu_blocks * config.cache_config.block_size

    def check_inputs(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Everything that can be checked before tokenizing; cheap whatever the input size."""
        check_request_id(request_id)
        if not -MAX_INT - 1 <= priority <= MAX_INT:
            raise InvalidRequestError(
                "priority", f"must be in [-2**63, 2**63), got {shown(priority)}"
            )
        if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_LEN:
            raise InvalidRequestError(
                "cache_salt", f"must be at most {MAX_CACHE_SALT_LEN} characters"
            )
        if isinstance(prompt, str):
            self._check_prompt_size(prompt)
        else:
            self._check_prompt_ids(prompt)
        self._check_params(params)

    def check_tokens(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        strict_max_tokens: bool = False,
    ) -> ValidatedRequest:
        """The checks on the tokenized prompt (its last `truncate_prompt_tokens` when set);
        returns the request ready to queue.

        `tenant` (a front end's caller identity) salts the prefix cache under `cache_salt`:
        tenants never share cached blocks, and `cache_salt` splits further within one.
        A `max_tokens` past the context length caps the output (CONTEXT_LIMIT), as in vLLM's
        Python API; with `strict_max_tokens` (the wire APIs' rule) it is an error instead.
        """
        keep = params.truncate_prompt_tokens
        if keep is not None:  # the prompt's end, as vLLM keeps it
            prompt_token_ids = prompt_token_ids[-(self.max_model_len if keep == -1 else keep) :]
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            raise InvalidRequestError("prompt", "is empty")
        if num_tokens >= self.max_model_len:
            raise self._no_room_for_output(num_tokens)
        if num_tokens > self.cache_capacity:
            raise InvalidRequestError(
                "prompt", f"is {num_tokens} tokens; the KV cache holds {self.cache_capacity}"
            )
        max_tokens = params.max_tokens
        if (
            strict_max_tokens
            and max_tokens is not None
            and num_tokens + max_tokens > self.max_model_len
        ):
            raise ContextLengthError(
                "max_tokens",
                f"{self._context_is()}; however, you requested {num_tokens + max_tokens} tokens "
                f"({num_tokens} in the prompt, {max_tokens} in the completion)",
            )
        self._check_output_len(num_tokens, params)
        return ValidatedRequest(
            request_id,
            prompt if isinstance(prompt, str) else None,
            list(prompt_token_ids),
            params,
            priority,
            # a pair, written unambiguously: no tenant's salt can spell another tenant's
            cache_salt if tenant is None else repr((tenant, cache_salt)),
        )

    def _check_output_len(self, num_tokens: int, params: SamplingParams) -> None:
        """A min_tokens the context cannot hold would run to the context limit regardless."""
        room = self.max_model_len - num_tokens
        if params.min_tokens > room:
            raise ContextLengthError(
                "min_tokens",
                f"{self._context_is()}; however, you requested at least "
                f"{num_tokens + params.min_tokens} tokens ({num_tokens} in the prompt, "
                f"{params.min_tokens} in the completion)",
            )

    def _context_is(self) -> str:
        # OpenAI's wording: litellm and other wrappers match "maximum context length"
        # and the engine's own name of the limit, for whoever sets it
        return f"this model's maximum context length is {self.max_model_len} tokens (max_model_len)"

    def _no_room_for_output(self, num_tokens: int) -> ContextLengthError:
        return ContextLengthError(
            "prompt",
            f"{self._context_is()}; however, the prompt alone is {num_tokens} tokens, "
            "with no room for output",
        )

    def check_structured_outputs(self, params: SamplingParams) -> CompiledConstraint | None:
        """The request's compiled constraint (None without one). Slow on a cache miss: the
        async engine calls it in a thread pool. One that does not compile is an error naming
        its field (`structured_outputs.json`, `.regex`, `.choice` or `.grammar`)."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        field = constraint_field(constraint)
        if self.grammars is None:
            raise InvalidRequestError(field, "this engine serves no structured outputs")
        try:
            return self.grammars.compile(constraint)
        except GrammarError as exc:
            raise InvalidRequestError(field, f"does not compile: {exc}") from None

    def _check_prompt_size(self, prompt: str) -> None:
        self.check_text_size("prompt", prompt)
        if not prompt:
            raise InvalidRequestError("prompt", "is empty")

    def check_text_size(self, field: str, text: str) -> None:
        """A text to tokenize (a prompt, or Tokenize's) is at most max_prompt_bytes of UTF-8."""
        limit = self.max_prompt_bytes
        # characters bound bytes from below and (x4) from above: encode only when it decides
        num_bytes = len(text)
        if num_bytes <= limit < num_bytes * _MAX_UTF8_BYTES_PER_CHAR:
            num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > limit:
            raise InvalidRequestError(
                field,
                f"is over {limit} bytes of text (max_prompt_bytes, derived from the context "
                f"length {self.max_model_len})",
            )

    def _check_prompt_ids(self, token_ids: list[int]) -> None:
        if len(token_ids) >= self.max_model_len:
            raise self._no_room_for_output(len(token_ids))
        self.check_token_ids("prompt", token_ids)

    def _check_params(self, params: SamplingParams) -> None:
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(
                "n",
                f"is {params.n}, more than max_num_seqs ({self.max_num_seqs}): the samples run "
                "at once, one sequence each",
            )
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        if params.logit_bias:
            self.check_token_ids("logit_bias", list(params.logit_bias))
        if params.allowed_token_ids:
            self.check_token_ids("allowed_token_ids", params.allowed_token_ids)
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(
                "logprobs", f"must be <= the vocabulary size ({self.vocab_size})"
            )

    def check_token_ids(self, field: str, token_ids: Sequence[int]) -> None:
        """Every id is in the vocabulary (what a token-id field of any call must hold).

        Runs on the event loop: the types and the range are checked by builtins over the
        whole sequence (~3x a Python loop), the loop only to name the bad ids."""
        if not token_ids:
            return
        is_ints = set(map(type, token_ids)) <= _INT_TYPES
        if is_ints and min(token_ids) >= 0 and max(token_ids) < self.vocab_size:
            return
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                field, f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}"
            )


def constraint_field(constraint: StructuredOutputsParams) -> str:
    """The engine field an error about `constraint` names (`structured_outputs.json`, ...)."""
    return f"structured_outputs.{constraint.kind}"
