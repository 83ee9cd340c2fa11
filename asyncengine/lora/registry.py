"""The engine's adapters: which are registered, which are in host memory, which in device slots.

Registered adapters are read from disk at registration (`add`, which callers run off their
event loop) and kept in host memory, least recently used evicted past `max_cpu_loras`. A
request whose adapter is no longer there waits: `is_ready` starts its load in a thread of its
own, so the step never reads a disk; a load that fails ends the requests waiting for it. The
device has `max_loras` slots; each step gives every adapter of its batch a slot (the scheduler
keeps the running requests to `max_loras` of them), reusing the least recently used slot of an
adapter no running request holds.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from asyncengine.config import LoRAConfig
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.errors import InvalidRequestError, LoRANotFoundError
from asyncengine.logging import get_logger
from asyncengine.lora.peft import LoRAWeights, load_adapter
from asyncengine.lora.request import LoRARequest

logger = get_logger(__name__)


class LoRARegistry:
    """Adapters by id, their host copies and their device slots (one engine's; one caller)."""

    def __init__(self, config: LoRAConfig, hf_config: Any, dtype: torch.dtype) -> None:
        self.config = config
        self.max_loras = config.max_loras
        self.hf_config, self.dtype = hf_config, dtype
        self.requests: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAWeights] = OrderedDict()  # least recent first
        self._loading: dict[int, Future[LoRAWeights]] = {}
        self._unreadable: set[int] = set()  # reads that failed, not yet taken by the scheduler
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._free_slots = list(range(config.max_loras - 1, -1, -1))
        self._loader: ThreadPoolExecutor | None = None
        self.num_loads = 0  # adapters copied into a device slot
        self.num_evictions = 0  # adapters whose slot went to another
        self.num_disk_loads = 0  # adapters read from disk (registration and reloads)
        self.num_host_evictions = 0  # host copies dropped past max_cpu_loras

    def read(self, lora_request: LoRARequest) -> LoRAWeights:
        """Read and check an adapter from disk (slow: callers run it off their loop)."""
        weights = load_adapter(lora_request, self.hf_config, self.config.max_lora_rank, self.dtype)
        self.num_disk_loads += 1
        return weights

    def read_in_background(self, lora_request: LoRARequest) -> Future[LoRAWeights]:
        """`read` in the loader thread."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="asyncengine-lora")
        return self._loader.submit(self.read, lora_request)

    def is_registered(self, lora_request: LoRARequest) -> bool:
        return self.requests.get(lora_request.lora_int_id) == lora_request

    def add(self, lora_request: LoRARequest, weights: LoRAWeights | None = None) -> bool:
        """Register an adapter (read now unless `weights` are given); False if it already is.

        An id registered under another name or path is an `InvalidRequestError`."""
        existing = self.requests.get(lora_request.lora_int_id)
        if existing is not None:
            if existing != lora_request:
                raise InvalidRequestError(
                    "lora_request.lora_int_id",
                    f"{lora_request.lora_int_id} is registered as {existing.lora_name!r} "
                    f"({existing.lora_path})",
                )
            return False
        for other in self.requests.values():
            if other.lora_name == lora_request.lora_name:
                raise InvalidRequestError(
                    "lora_request.lora_name",
                    f"{other.lora_name!r} is registered with id {other.lora_int_id}",
                )
        self._host[lora_request.lora_int_id] = weights or self.read(lora_request)
        self.requests[lora_request.lora_int_id] = lora_request
        self._trim_host(keep={lora_request.lora_int_id})
        return True

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (the engine checked that no request uses it)."""
        if self.requests.pop(lora_int_id, None) is None:
            raise LoRANotFoundError(lora_int_id)
        self._host.pop(lora_int_id, None)
        loading = self._loading.pop(lora_int_id, None)
        if loading is not None:
            loading.cancel()
        slot = self._slots.pop(lora_int_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def ids(self) -> set[int]:
        return set(self.requests)

    def is_ready(self, lora_int_id: int) -> bool:
        """Whether the adapter is in a slot or in host memory; if neither, its read starts
        (in the loader thread) and a later call finds it."""
        if lora_int_id in self._slots or lora_int_id in self._host:
            return True
        loading = self._loading.get(lora_int_id)
        if loading is None:
            lora_request = self.requests[lora_int_id]
            # its host copy was evicted past max_cpu_loras: read again, off the step
            logger.info("lora_reading", lora_name=lora_request.lora_name, lora_int_id=lora_int_id)
            self._loading[lora_int_id] = self.read_in_background(lora_request)
            return False
        if not loading.done():
            return False
        del self._loading[lora_int_id]
        try:
            self._host[lora_int_id] = loading.result()
        except Exception as exc:  # the directory changed since registration
            logger.error("lora_load_failed", lora_int_id=lora_int_id, cause=repr(exc))
            self._unreadable.add(lora_int_id)
            return False
        return True

    def take_unreadable(self) -> set[int]:
        """The adapters whose read from disk failed since the last call: the requests waiting
        for them end with an error, and a later request reads it again (the files may be
        back), so a broken directory costs one read per wave of requests, not one per step."""
        unreadable, self._unreadable = self._unreadable, set()
        return unreadable

    def wait_for_reads(self, timeout_s: float) -> None:
        """Block until an adapter read ends, or `timeout_s` (at once when none runs)."""
        if self._loading:
            wait(list(self._loading.values()), timeout_s, return_when=FIRST_COMPLETED)

    def assign_slots(self, plan: SchedulerOutput, running: set[int]) -> None:
        """Give each adapter of `plan` a device slot, loading those not in one already."""
        needed = {req.lora_int_id for req in plan.scheduled if req.lora_int_id}
        for lora_int_id in sorted(needed):
            if lora_int_id in self._slots:
                self._slots.move_to_end(lora_int_id)
                continue
            slot = self._free_slots.pop() if self._free_slots else self._evict(running)
            self._slots[lora_int_id] = slot
            plan.lora_loads[slot] = self._host[lora_int_id]
            self._host.move_to_end(lora_int_id)
            self.num_loads += 1
        plan.lora_slots = {lora_int_id: self._slots[lora_int_id] for lora_int_id in needed}
        self._trim_host(keep=running)

    def _evict(self, running: set[int]) -> int:
        victim = next(i for i in self._slots if i not in running)
        self.num_evictions += 1
        return self._slots.pop(victim)

    def _trim_host(self, keep: set[int]) -> None:
        """Evict the least recently used host copies past max_cpu_loras, never one in `keep`
        (after a step's slots are given, those of running requests: one may be recomputed
        after its slot went to another; at registration, the new adapter)."""
        excess = len(self._host) - self.config.max_cpu_loras
        for lora_int_id in [i for i in self._host if i not in keep][: max(excess, 0)]:
            del self._host[lora_int_id]
            self.num_host_evictions += 1
            logger.info(
                "lora_host_evicted",
                lora_int_id=lora_int_id,
                max_cpu_loras=self.config.max_cpu_loras,
            )

    @property
    def num_resident(self) -> int:
        return len(self._slots)

    @property
    def num_cached(self) -> int:
        return len(self._host)

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
