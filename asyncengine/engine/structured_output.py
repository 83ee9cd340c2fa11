"""Structured outputs with xgrammar: each constraint compiled once, one matcher per sample.

A request's constraint is compiled when the request is added (`compile`: thread-safe, cached
by (kind, spec) within a byte bound; the async engine runs it in the engine's compile pool,
engine/grammar_compiles.py), so it enters the scheduler with its grammar ready and the
scheduler never knows of grammars. Each step the model runner asks for the token bitmask of
its constrained rows (`fill_masks`, in the worker thread, while the forward runs) and the
sampler applies it before sampling; the engine then advances each matcher with its sample's
new tokens (`accept`). A speculating sample's drafts are verified under its grammar
(`for_drafts`: its matcher stepped over the drafts it keeps, then rolled back). A matcher
lives with its sample: swap and recompute keep a sample's tokens, and so its matcher's state,
as it is. xgrammar sees the vocabulary as the text does (engine/grammar_vocab.py): special
tokens never match, and no sample writes a surrogate.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.core.request import Request
from asyncengine.engine.grammar_vocab import Utf8Guard, tokenizer_info
from asyncengine.sampling_params import StructuredOutputsParams
from asyncengine.worker.sampler import GrammarMasks

_MAX_ERROR_LEN = 300
# xgrammar's errors start with a time and a C++ source location: "[12:00:00] /x/y.cc:94: "
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar (0.2.9) lets a string with minLength/maxLength hold raw control characters, which
# JSON forbids there: its character rule for such strings, and the one it should be
_LENGTH_LIMITED_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why (xgrammar's words)."""


@dataclass(frozen=True)
class CompiledConstraint:
    """A request's compiled constraint, ready for matchers."""

    kind: str  # StructuredOutputsParams.kind
    grammar: Any  # xgrammar.CompiledGrammar
    compile_s: float | None  # seconds it took; None when it came from the cache


@dataclass
class _Group:
    """One caller's request: its grammar and a matcher per sample (by engine request id)."""

    grammar: Any
    matchers: dict[str, Any] = field(default_factory=dict)


class StructuredOutputManager:
    """xgrammar for one tokenizer: the compiler, the compiled-grammar cache and the matchers.

    `compile` may run in any thread (several at once); the matcher calls follow the step:
    `prepare` and `accept` on the engine's thread, `fill_masks` in the worker thread between
    them. xgrammar is imported on first use, so an engine that never sees a constraint never
    loads it.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_cache_bytes: int = 256 << 20,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._utf8: Utf8Guard | None = None  # built with the compiler, from its token bytes
        self._compiler_lock = threading.Lock()
        self._lock = threading.Lock()
        # least recently used first; a grammar evicted stays alive while a request holds it
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self.max_cache_bytes = max_cache_bytes
        self.cache_bytes = 0
        # a spec being compiled: later requests for it wait on the first one's compile
        self._compiling: dict[tuple[str, str, bool], Future[Any]] = {}
        self._groups: dict[str, _Group] = {}

    # -- compiling (any thread) --------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled grammar of `params`, from the cache or compiled now (slow: call it off
        the event loop). A constraint that does not compile raises `GrammarError`."""
        kind = params.kind
        key = (kind, _spec(params), params.disable_any_whitespace)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return CompiledConstraint(kind, grammar, None)
            pending = self._compiling.get(key)
            if pending is None:
                future: Future[Any] = Future()
                self._compiling[key] = future
        if pending is not None:
            return CompiledConstraint(kind, pending.result(), None)  # or its GrammarError
        started = time.perf_counter()
        try:
            grammar = self._compile(params)
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[key]
            self._cache_put(key, grammar)
        future.set_result(grammar)
        return CompiledConstraint(kind, grammar, time.perf_counter() - started)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _cache_put(self, key: tuple[str, str, bool], grammar: Any) -> None:
        """Keep `grammar`, evicting the least recently used past max_cache_bytes (one larger
        than the bound alone is not kept). Under `_lock`."""
        size = int(grammar.memory_size_bytes)
        if size > self.max_cache_bytes:
            return
        self._cache[key] = grammar
        self.cache_bytes += size
        while self.cache_bytes > self.max_cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self.cache_bytes -= int(evicted.memory_size_bytes)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        any_whitespace = not params.disable_any_whitespace
        try:
            if params.json is not None or params.json_object:
                schema = _JSON_OBJECT_SCHEMA if params.json is None else params.json
                return compiler.compile_grammar(json_schema_grammar(schema, any_whitespace))
            if params.regex is not None:
                return compiler.compile_regex(params.regex)
            if params.choice is not None:
                return compiler.compile_grammar(choice_grammar(params.choice))
            assert params.grammar is not None
            return compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError (and others) for a bad spec
            raise GrammarError(_error_text(exc)) from None

    def _get_compiler(self) -> Any:
        """The compiler for this tokenizer, built on first use (a large vocabulary takes a
        while: this runs in the compiling thread, never on the event loop)."""
        with self._compiler_lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise GrammarError(
                        "structured outputs need xgrammar, which this installation lacks: "
                        "pip install 'asyncengine[structured]'"
                    ) from None

                info = tokenizer_info(self._tokenizer, self.vocab_size, self._eos_token_ids)
                self._utf8 = Utf8Guard(info.decoded_vocab, self.vocab_size)
                # compiled grammars are cached here, bounded by bytes, with in-flight sharing;
                # one thread: the compile runs in its caller's (bounded) pool thread
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    # -- matchers (the step) -----------------------------------------------------------------

    @property
    def has_requests(self) -> bool:
        return bool(self._groups)

    def add(self, group_id: str, constraint: CompiledConstraint) -> None:
        """Constrain every sample of request group `group_id`."""
        self._groups[group_id] = _Group(constraint.grammar)

    def release(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    def is_constrained(self, req: Request) -> bool:
        return req.group_id in self._groups

    def prepare(self, reqs: list[Request]) -> None:
        """Give each scheduled sample of a constrained request its matcher, before its first
        step (samples forked from a request start, as it did, with no output)."""
        if not self._groups:
            return
        import xgrammar as xgr

        for req in reqs:
            group = self._groups.get(req.group_id)
            if group is not None and req.request_id not in group.matchers:
                group.matchers[req.request_id] = xgr.GrammarMatcher(group.grammar)

    def fill_masks(self, reqs: list[Request]) -> GrammarMasks | None:
        """The allowed next tokens of each constrained row of `reqs` (the rows that sample this
        step); None when no row is constrained. A row whose matcher fails is reported in
        `failures`, for its request alone to fail."""
        import xgrammar as xgr

        bitmask = None
        rows: list[int] = []
        failures: dict[int, BaseException] = {}
        for row, req in enumerate(reqs):
            group = self._groups.get(req.group_id)
            if group is None:
                continue
            if bitmask is None:
                bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
            # a constrained request's grammar compiled: the compiler and its guard exist
            assert self._utf8 is not None
            try:
                # a row xgrammar leaves all-allowed (it returns False) is restricted all the same
                group.matchers[req.request_id].fill_next_token_bitmask(bitmask, row)
                last = req.token_ids[-1] if req.num_output_tokens else None
                if not self._utf8.restrict(bitmask, row, last):
                    raise GrammarError("the grammar allows only a UTF-16 surrogate here")
                rows.append(row)
            except Exception as exc:
                failures[row] = exc
        if bitmask is None:
            return None
        return GrammarMasks(bitmask, rows, failures)

    def accept(self, req: Request, num_tokens: int = 1) -> bool:
        """Advance `req`'s matcher by its last `num_tokens` tokens (a step's accepted drafts
        and sampled token); True once the grammar has ended (it accepted a stop token). A
        token the grammar rejects raises `GrammarError`."""
        matcher = self._groups[req.group_id].matchers[req.request_id]
        for token_id in req.token_ids[-num_tokens:]:
            if not matcher.accept_token(token_id):
                raise GrammarError(f"the grammar rejected sampled token {token_id}")
        return bool(matcher.is_terminated())

    def for_drafts(self, req: Request) -> DraftCursor | None:
        """`req`'s matcher, to step over its drafts while they are verified (in the worker
        thread, between `prepare` and `accept` as `fill_masks` is)."""
        group = self._groups.get(req.group_id)
        if group is None:
            return None
        assert self._utf8 is not None  # its grammar compiled: the compiler and guard exist
        last = req.token_ids[-1] if req.num_output_tokens else None
        return DraftCursor(group.matchers[req.request_id], self._utf8, self.vocab_size, last)


class DraftCursor:
    """One sample's matcher stepped ahead over drafts, then rolled back (`DraftGrammar`)."""

    def __init__(self, matcher: Any, utf8: Utf8Guard, vocab_size: int, last: int | None) -> None:
        import xgrammar as xgr

        self._matcher, self._utf8, self._last = matcher, utf8, last
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._num_advanced = 0

    def restrict(self, logits: torch.Tensor) -> None:
        import xgrammar as xgr

        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        if not self._utf8.restrict(self._bitmask, 0, self._last):
            raise GrammarError("the grammar allows only a UTF-16 surrogate here")
        bitmask = self._bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask)

    def advance(self, token_id: int) -> bool:
        if not self._matcher.accept_token(token_id):
            raise GrammarError(f"the grammar rejected draft token {token_id}")
        self._num_advanced += 1
        self._last = token_id
        return bool(self._matcher.is_terminated())

    def rollback(self) -> None:
        if self._num_advanced:
            self._matcher.rollback(self._num_advanced)
            self._num_advanced = 0


def json_schema_grammar(schema: str | dict[str, Any], any_whitespace: bool) -> str:
    """xgrammar's EBNF for a JSON schema, with raw control characters kept out of strings."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    # only strings exclude quotes and backslashes: tightening the rule touches nothing else
    return ebnf.replace(_LENGTH_LIMITED_CHAR, _JSON_STRING_CHAR)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _spec(params: StructuredOutputsParams) -> str:
    if params.choice is not None:
        return json.dumps(params.choice, ensure_ascii=False)
    value = params.json or params.regex or params.grammar
    return value if isinstance(value, str) else ""


def _error_text(exc: Exception) -> str:
    text = _ERROR_PREFIX.sub("", str(exc).strip()).strip()
    text = text.split("\n")[0] or type(exc).__name__
    return text if len(text) <= _MAX_ERROR_LEN else text[: _MAX_ERROR_LEN - 3] + "..."
