"""A fixed set of KV blocks on one device: O(1) allocate and free, reference counts, and a
content-addressed index of full blocks (the prefix cache)."""

from __future__ import annotations

from collections import Counter, OrderedDict

from asyncengine.core.kv_events import CLEARED, KvEvent, KvEventKind, KvEventLog


class NoFreeBlocksError(RuntimeError):
    """A pool was asked for a block it does not have (a scheduler bug, never user input)."""


class BlockPool:
    """Blocks are ints; each has a reference count (how many block tables hold it).

    Free blocks wait in least-recently-freed order. A full block can be registered under the hash
    of its content (parent hash + token ids); when freed it keeps that identity, so a later
    request with the same prefix can take it back, until allocation needs it and evicts it.
    The token ids are kept beside the hash, so a hash collision can never hand out wrong K/V.
    """

    def __init__(self, num_blocks: int, events: KvEventLog | None = None) -> None:
        self.num_blocks = num_blocks
        self.events = events  # what enters and leaves `cached`, when someone follows it
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # content hash -> block

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the least recently freed block, forgetting any cached content it held."""
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block, _ = self._free.popitem(last=False)
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None

    # -- prefix cache ------------------------------------------------------------------------

    def lookup(self, content_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block holding exactly these tokens under this hash, if cached."""
        block = self.cached.get(content_hash)
        if block is None or self.block_tokens[block] != token_ids:
            return None
        return block

    def is_idle(self, block: int) -> bool:
        return self.ref_counts[block] == 0

    def take(self, block: int) -> None:
        """Hold a cached block again (out of the free queue if nobody held it)."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def register(
        self,
        block: int,
        content_hash: int,
        token_ids: tuple[int, ...],
        parent_hash: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Record that a full block now holds K/V for `token_ids` after the hashed prefix
        (`parent_hash` and the salt's namespace `cache_salt` only describe it to events)."""
        self.block_hash[block] = content_hash
        self.block_tokens[block] = token_ids
        # Of two copies of the same content (computed concurrently, or swapped back in) the
        # index keeps a held one: an idle copy is the next to be evicted.
        indexed = self.cached.get(content_hash)
        if indexed is None or self.ref_counts[indexed] == 0:
            self.cached[content_hash] = block
            if indexed is None and self.events is not None:
                self.events.append(
                    KvEvent(KvEventKind.STORED, content_hash, parent_hash, token_ids, cache_salt)
                )

    def _forget(self, block: int) -> None:
        content_hash = self.block_hash[block]
        if content_hash is not None and self.cached.get(content_hash) == block:
            del self.cached[content_hash]
            if self.events is not None:
                self.events.append(KvEvent(KvEventKind.REMOVED, content_hash))
        self.block_hash[block] = None
        self.block_tokens[block] = None

    def reset_cache(self) -> bool:
        """Forget every cached block's content, if no block is held (a held block's K/V may
        be read by its request's next step); whether it did."""
        if self.num_free != self.num_blocks:
            return False
        for block in range(self.num_blocks):
            self.block_hash[block] = None
            self.block_tokens[block] = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(CLEARED)
        return True

    def check_invariants(self, holders: Counter[int]) -> None:
        """`holders[b]` = how many tables hold block b; it must equal b's reference count."""
        for block, ref_count in enumerate(self.ref_counts):
            assert ref_count == holders.get(block, 0), (
                f"block {block}: ref_count {ref_count} but held by {holders.get(block, 0)} tables"
            )
            assert (ref_count == 0) == (block in self._free), (
                f"block {block}: free list out of sync"
            )
        assert self.num_free + sum(1 for r in self.ref_counts if r) == self.num_blocks
        for content_hash, block in self.cached.items():
            assert self.block_hash[block] == content_hash, f"block {block}: stale cache entry"
