"""KV-cache events: which full blocks the prefix cache holds, as routers (SMG, vLLM's KV-aware
routing, Dynamo) follow it. A block is stored when the cache indexes it, removed when it leaves
the index (evicted, or replaced by nothing), and everything is cleared on a reset."""

from __future__ import annotations

import enum
import functools
import hashlib
from dataclasses import dataclass


class KvEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True)
class KvEvent:
    """One change to the cache's index. `block_hash` names a block's content and its whole
    prefix (a signed 64-bit int); `parent_hash` the block before it (None: the first)."""

    kind: KvEventKind
    block_hash: int = 0
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    # the salt's namespace as a digest (never the salt itself); None: unsalted
    cache_salt: str | None = None


CLEARED = KvEvent(KvEventKind.CLEARED)


@functools.lru_cache(maxsize=4096)
def chain_root(cache_salt: str | None, lora_int_id: int = 0) -> int:
    """The parent hash of a chain's first block: the same in every process and replica, so
    two replicas name the same prefix alike (Python's own str hash differs per process).

    The LoRA adapter seeds it too: K/V computed under one adapter is never another's."""
    seed = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    if lora_int_id:
        seed += b"|lora:%d" % lora_int_id
    return int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "little", signed=True)


def salt_namespace(cache_salt: str | None) -> str | None:
    return None if cache_salt is None else f"{chain_root(cache_salt) & (2**64 - 1):016x}"


class KvEventLog:
    """Events since the last `take`, bounded: past `max_events` (nobody took them) they give
    way to one CLEARED, after which a consumer knows less than the cache holds, never more."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self._events: list[KvEvent] = []

    def append(self, event: KvEvent) -> None:
        if len(self._events) >= self.max_events:
            self._events = [CLEARED]
        self._events.append(event)

    def take(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events
