"""The server core's LoRA adapters: `--lora-modules` entries, and the adapters a server serves by
name over the engine's registry, loaded at start-up and (with --allow-runtime-lora-updating) at
run time. Both front ends load, unload, list and resolve adapters here only."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncengine.errors import InvalidRequestError, LoRANotFoundError
from asyncengine.logging import get_logger
from asyncengine.lora.request import LoRARequest
from asyncengine.server.errors import DuplicateLoRAError, RuntimeLoRAUpdatingDisabledError
from asyncengine.server.options import ServeOptions

if TYPE_CHECKING:
    from asyncengine.engine.async_llm_engine import AsyncLLMEngine

logger = get_logger(__name__)

_JSON_KEYS = {"name", "path", "base_model_name"}


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry: the adapter in PEFT directory `path`, served as `name`."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`;
    ValueError naming the flag otherwise."""
    value = value.strip()
    if value.startswith("{"):
        return _parse_json_module(value)
    name, has_equals, path = value.partition("=")
    if not has_equals or not name.strip() or not path.strip():
        raise ValueError(
            f"--lora-modules: {value!r} is neither name=path nor a JSON object with name and path"
        )
    return LoRAModule(name.strip(), path.strip())


def _parse_json_module(value: str) -> LoRAModule:
    try:
        entry = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({exc.msg})") from None
    if not isinstance(entry, dict) or not {"name", "path"} <= entry.keys():
        raise ValueError(f"--lora-modules: {value!r} needs the keys name and path")
    unknown = sorted(entry.keys() - _JSON_KEYS)
    if unknown:
        raise ValueError(f"--lora-modules: {value!r} has unknown keys {unknown}")
    base = entry.get("base_model_name")
    if not all(isinstance(entry[key], str) and entry[key] for key in ("name", "path")) or not (
        base is None or isinstance(base, str)
    ):
        raise ValueError(f"--lora-modules: {value!r}: name and path must be non-empty strings")
    return LoRAModule(entry["name"], entry["path"], base)


def check_lora_options(options: ServeOptions, is_lora_enabled: bool) -> list[LoRAModule]:
    """The --lora-modules entries, parsed; ValueError for a bad one, or for LoRA flags on an
    engine without --enable-lora. Run before the model loads."""
    modules = [parse_lora_module(value) for value in options.lora_modules]
    if not is_lora_enabled:
        for flag, is_set in (
            ("--lora-modules", bool(modules)),
            ("--allow-runtime-lora-updating", options.allow_runtime_lora_updating),
        ):
            if is_set:
                raise ValueError(f"{flag} needs --enable-lora")
    return modules


def check_lora_modules(modules: list[LoRAModule], base_names: frozenset[str]) -> None:
    """Names unique and apart from the base model's; a base_model_name naming the served model."""
    seen: set[str] = set()
    for module in modules:
        if module.name in base_names:
            raise ValueError(f"--lora-modules: {module.name!r} is the base model's own name")
        if module.name in seen:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        seen.add(module.name)
        if module.base_model_name is not None and module.base_model_name not in base_names:
            raise ValueError(
                f"--lora-modules: base_model_name {module.base_model_name!r} of {module.name!r} "
                f"is not the served model ({', '.join(sorted(base_names))})"
            )


class LoRAAdapters:
    """The adapters a server serves, by name. The engine's registry (`lora_requests()`) owns
    them; this gives each loaded adapter its id (1, 2, ... in load order, never reused, so a name
    loaded again is a new adapter to every cache) and runs one load or unload at a time."""

    def __init__(
        self, engine: AsyncLLMEngine, base_names: frozenset[str], allow_runtime_updates: bool
    ) -> None:
        self._engine = engine
        self._base_names = base_names
        self.allow_runtime_updates = allow_runtime_updates
        self._next_id = 1
        self._lock = asyncio.Lock()
        # requests naming each adapter on their way into the engine, and the adapters being
        # unloaded: an unload waits for the first, a request for the second (`handing`)
        self._num_handing: Counter[int] = Counter()
        self._handed: dict[int, asyncio.Event] = {}  # set when an adapter's hand-overs end
        self._unloading: dict[int, asyncio.Event] = {}  # set when its unload ends

    def get(self, name: str) -> LoRARequest | None:
        """The adapter served as `name`; None when there is none (a base model name included)."""
        return self._engine.lora_requests().get(name)

    def resolve(self, name: str) -> LoRARequest | None:
        """What a request's `lora_name` asks for: an adapter, or None for the base (an empty
        name); LoRANotFoundError naming an adapter the server does not have."""
        if not name:
            return None
        adapter = self.get(name)
        if adapter is None:
            raise LoRANotFoundError(name)
        return adapter

    def all(self) -> list[LoRARequest]:
        """Every adapter served, in load order."""
        return sorted(self._engine.lora_requests().values(), key=lambda a: a.lora_int_id)

    async def load_modules(self, modules: list[LoRAModule]) -> None:
        """Load --lora-modules at start-up; ValueError naming the entry that cannot be served."""
        for module in modules:
            try:
                await self._load(module.name, module.path)
            except InvalidRequestError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from None

    async def load(self, name: str, path: str) -> LoRARequest:
        """Load an adapter at run time (LoadLoRA, /v1/load_lora_adapter)."""
        self._check_runtime_updates()
        if not name:
            raise InvalidRequestError("lora_name", "is required")
        if not path:
            raise InvalidRequestError("lora_path", "is required")
        if name in self._base_names:
            raise InvalidRequestError("lora_name", f"{name!r} is the base model's own name")
        return await self._load(name, path)

    async def unload(self, name: str) -> LoRARequest:
        """Unload an adapter at run time; LoRAInUseError (the engine's) while requests use it,
        and then it stays loaded."""
        self._check_runtime_updates()
        async with self._lock:
            adapter = self.get(name)
            if adapter is None:
                raise LoRANotFoundError(name)
            lora_int_id = adapter.lora_int_id
            done = self._unloading[lora_int_id] = asyncio.Event()
            try:
                while self._num_handing[lora_int_id]:  # on their way in: the engine counts them
                    await self._handed.setdefault(lora_int_id, asyncio.Event()).wait()
                await self._engine.remove_lora(lora_int_id)
            finally:
                del self._unloading[lora_int_id]
                done.set()
        logger.info("lora_unloaded", lora_name=name, lora_id=adapter.lora_int_id)
        return adapter

    @contextlib.asynccontextmanager
    async def handing(self, adapter: LoRARequest | None) -> AsyncIterator[None]:
        """Hold `adapter` while a request naming it is handed to the engine (None: the base
        model, nothing to hold). An unload waits until the engine has the request, which then
        makes the engine refuse it (in use); a request that meets an unload in flight waits
        for it: LoRANotFoundError if the adapter went, as for one unloaded before the request
        came. Without this the request could reach the engine after its adapter left."""
        if adapter is None:
            yield
            return
        lora_int_id = adapter.lora_int_id
        while (unloading := self._unloading.get(lora_int_id)) is not None:
            await unloading.wait()
        if self.get(adapter.lora_name) != adapter:  # unloaded since the caller named it
            raise LoRANotFoundError(adapter.lora_name)
        self._num_handing[lora_int_id] += 1
        try:
            yield
        finally:
            self._num_handing[lora_int_id] -= 1
            if not self._num_handing[lora_int_id]:
                del self._num_handing[lora_int_id]
                handed = self._handed.pop(lora_int_id, None)
                if handed is not None:
                    handed.set()

    async def _load(self, name: str, path: str) -> LoRARequest:
        async with self._lock:
            registered = self._engine.lora_requests()
            if name in registered:
                raise DuplicateLoRAError(name)
            # ids the engine already holds (adapters of its own caller) are never given again
            newest = max((a.lora_int_id for a in registered.values()), default=0)
            self._next_id = max(self._next_id, newest + 1)
            adapter = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path)
            self._next_id += 1
            try:
                await self._engine.add_lora(adapter)
            except InvalidRequestError as exc:
                raise _named_by_path(exc) from None
        logger.info("lora_loaded", lora_name=name, lora_id=adapter.lora_int_id, lora_path=path)
        return adapter

    def _check_runtime_updates(self) -> None:
        if not self.allow_runtime_updates:
            raise RuntimeLoRAUpdatingDisabledError(
                "run-time LoRA updates are off: start the server with --enable-lora and "
                "--allow-runtime-lora-updating to load and unload adapters"
            )


def _named_by_path(exc: InvalidRequestError) -> InvalidRequestError:
    """The engine's refusal of an adapter (`lora_request...`: its directory, files, rank or
    target modules) named by the field callers give, `lora_path`."""
    if not exc.field.startswith("lora_request"):
        return exc
    return InvalidRequestError("lora_path", exc.description)
