"""The engine's KV-cache events for subscribers: numbered batches, a bounded history to resume
from, and a resync (CLEARED, then every live block) for a subscriber that fell behind.

Each step's events (core/kv_events.py) become one batch with the next sequence number. A
subscriber's queue is bounded: one that does not keep up loses its queued batches and gets a
snapshot instead, numbered so that the live batches after it follow with no gap and no
duplicate (the shape of smg's `KvSnapshotChunk`). Nothing waits on a slow subscriber.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from asyncengine.core.kv_events import CLEARED, KvEvent, KvEventKind

HISTORY_LEN = 256  # batches kept for subscribers resuming from a sequence number
QUEUE_LEN = 256  # batches a subscriber may have unread before it is resynced instead
SNAPSHOT_CHUNK_BLOCKS = 4096  # blocks per snapshot batch (a gRPC message stays small)
MAX_SUBSCRIBERS = 64


@dataclass(frozen=True)
class SnapshotChunk:
    """Marks a batch as chunk `index` of `count` of a resync listing `num_blocks` blocks."""

    index: int
    count: int
    num_blocks: int


@dataclass(frozen=True)
class KvEventBatch:
    sequence_number: int
    timestamp: float  # seconds since the epoch, when the engine's step published it
    events: tuple[KvEvent, ...]
    snapshot: SnapshotChunk | None = None


class TooManySubscribersError(RuntimeError):
    """Every subscription slot is taken."""


class KvEventHub:
    """Numbers the engine's events, fans them out, and keeps what a resync needs: the live
    blocks as the events describe them (bounded by the cache's own index)."""

    def __init__(
        self,
        history_len: int = HISTORY_LEN,
        queue_len: int = QUEUE_LEN,
        chunk_blocks: int = SNAPSHOT_CHUNK_BLOCKS,
    ) -> None:
        self.sequence_number = 0  # of the last batch published
        self._history: deque[KvEventBatch] = deque(maxlen=history_len)
        self._live: dict[int, KvEvent] = {}  # block hash -> the event that stored it
        self._subscribers: set[KvEventSubscription] = set()
        self._queue_len = queue_len
        self._chunk_blocks = chunk_blocks
        self.is_closed = False

    def publish(self, events: list[KvEvent]) -> None:
        self.sequence_number += 1
        batch = KvEventBatch(self.sequence_number, time.time(), tuple(events))
        live = self._live
        for event in events:
            if event.kind is KvEventKind.STORED:
                live[event.block_hash] = event
            elif event.kind is KvEventKind.REMOVED:
                live.pop(event.block_hash, None)
            else:
                live.clear()
        self._history.append(batch)
        for subscriber in self._subscribers:
            subscriber.push(batch)

    def subscribe(self, start_sequence_number: int = 0) -> KvEventSubscription:
        """From `start_sequence_number` on (the batches after it) if the history still holds
        them; else (and for 0) from a snapshot of the live blocks."""
        if self.is_closed:
            raise RuntimeError("the engine has stopped")
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            raise TooManySubscribersError(f"at most {MAX_SUBSCRIBERS} KV event subscribers")
        subscriber = KvEventSubscription(self, self._queue_len)
        start = start_sequence_number
        oldest = self._history[0].sequence_number if self._history else self.sequence_number + 1
        if 0 < start <= self.sequence_number and start + 1 >= oldest:
            for batch in self._history:
                if batch.sequence_number > start:
                    subscriber.push(batch)
        else:
            subscriber.needs_resync = True
        self._subscribers.add(subscriber)
        return subscriber

    def snapshot(self) -> list[KvEventBatch]:
        """CLEARED, then every live block (parents first), in batches numbered up to the last
        sequence number: live batches continue after it."""
        blocks = _parents_first(self._live)
        num_chunks = -(-len(blocks) // self._chunk_blocks) or 1
        num_chunks = min(num_chunks, self.sequence_number + 1)
        size = -(-len(blocks) // num_chunks) if blocks else 0
        now, first = time.time(), self.sequence_number - num_chunks + 1
        batches = []
        for index in range(num_chunks):
            events = tuple(blocks[index * size : (index + 1) * size])
            chunk = SnapshotChunk(index, num_chunks, len(blocks))
            events = (CLEARED, *events) if index == 0 else events
            batches.append(KvEventBatch(first + index, now, events, chunk))
        return batches

    def close(self) -> None:
        """The engine stopped: every subscription ends after what it has queued."""
        self.is_closed = True
        for subscriber in list(self._subscribers):
            subscriber.end()

    def _unsubscribe(self, subscriber: KvEventSubscription) -> None:
        self._subscribers.discard(subscriber)


class KvEventSubscription:
    """An async iterator of batches; `close()` (or `async with`) ends it."""

    def __init__(self, hub: KvEventHub, queue_len: int) -> None:
        self._hub = hub
        self._queue_len = queue_len
        self._pending: deque[KvEventBatch] = deque()
        self._wake = asyncio.Event()
        self._is_ended = False
        self.needs_resync = False
        self.num_resyncs = 0  # times it fell behind and was resynced

    def push(self, batch: KvEventBatch) -> None:
        if self.needs_resync:
            return  # the snapshot it will get covers this batch
        if len(self._pending) >= self._queue_len:
            self._pending.clear()
            self.needs_resync = True
            self.num_resyncs += 1
        else:
            self._pending.append(batch)
        self._wake.set()

    def end(self) -> None:
        self._is_ended = True
        self._wake.set()

    def close(self) -> None:
        self.end()
        self._hub._unsubscribe(self)

    def __aiter__(self) -> KvEventSubscription:
        return self

    async def __anext__(self) -> KvEventBatch:
        while True:
            if self.needs_resync and not self._is_ended:
                # taken now, so it is numbered with the last batch this subscriber skipped
                self.needs_resync = False
                self._pending.extend(self._hub.snapshot())
            if self._pending:
                return self._pending.popleft()
            if self._is_ended:
                self.close()
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()

    async def __aenter__(self) -> KvEventSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def _parents_first(live: dict[int, KvEvent]) -> list[KvEvent]:
    """The live blocks ordered by depth in their chain, so a parent comes before its child."""
    depth: dict[int, int] = {}
    for block_hash in live:
        chain: list[int] = []
        current: int | None = block_hash
        assert current is not None
        while current in live and current not in depth and len(chain) <= len(live):
            chain.append(current)
            current = live[current].parent_hash
        base = depth.get(current, -1) if current is not None else -1
        for offset, member in enumerate(reversed(chain), start=1):
            depth[member] = base + offset
    return sorted(live.values(), key=lambda event: depth[event.block_hash])
