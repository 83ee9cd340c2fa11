"""The paged KV cache's bookkeeping: block pools, per-request block tables, swap and fork.

No tensors here: blocks are integer ids; the worker owns the memory behind them and applies
the (src, dst) pairs this module returns for copies and swaps.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

from asyncengine.core.block_pool import BlockPool, NoFreeBlocksError
from asyncengine.core.kv_events import KvEvent, KvEventLog, chain_root, salt_namespace

__all__ = [
    "RELEASED",
    "AllocStatus",
    "BlockPool",
    "BlockSpaceManager",
    "BlockTable",
    "NoFreeBlocksError",
    "Sequence",
]


# a block-table entry whose block was released (outside a sliding window): never read
RELEASED = -1


def live(table: list[int]) -> list[int]:
    return [block for block in table if block != RELEASED]


class AllocStatus(enum.Enum):
    """Whether an allocation fits; true only for OK, so `if can_allocate(...)` reads right."""

    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once other requests free blocks
    NEVER = enum.auto()  # can never fit in this cache

    def __bool__(self) -> bool:
        return self is AllocStatus.OK


class HasId(Protocol):
    """Names the sequence whose blocks a call is about (a request, or a `BlockTable`)."""

    request_id: str


class Sequence(Protocol):
    """What the block manager needs to know of a request."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    lora_int_id: int  # the LoRA adapter (0: the base model): a part of every block's key
    num_computed_tokens: int  # K/V up to here is in the cache; writes start here

    @property
    def num_tokens(self) -> int: ...


class BlockTable(list[int]):
    """One sequence's physical block ids in logical order, as `allocate` returns them.

    It is the manager's own table, so it grows with `append_slot`. `request_id` names the
    sequence (pass the table itself to `free`); `num_cached_tokens` is how many of the
    sequence's leading tokens already had K/V in the prefix cache when it was allocated.
    """

    def __init__(self, blocks: Iterable[int], request_id: str, num_cached_tokens: int = 0) -> None:
        super().__init__(blocks)
        self.request_id = request_id
        self.num_cached_tokens = num_cached_tokens


class BlockSpaceManager:
    """Maps each request's logical blocks to physical blocks in a GPU pool and a CPU swap pool.

    A request's table covers all of its tokens (only the last block may be partly filled).
    The GPU pool is the device's KV memory (host memory when the device is the CPU).
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        sliding_window: int | None = None,
        watermark: float = 0.01,
        enable_caching: bool = False,
        enable_kv_events: bool = False,
    ) -> None:
        """`enable_kv_events`: record what the prefix cache stores and removes, for
        `take_kv_events` (at least once a step, else the oldest give way to a CLEARED)."""
        if enable_caching and sliding_window is not None:
            raise ValueError("prefix caching does not support sliding-window attention")
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.sliding_window = sliding_window
        # keep a few blocks back from admissions so running requests can still grow
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.kv_events = (
            KvEventLog(max_events=4 * num_gpu_blocks + 64)
            if enable_caching and enable_kv_events
            else None
        )
        self.gpu_pool = BlockPool(num_gpu_blocks, self.kv_events)
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self.block_tables: dict[str, list[int]] = {}  # requests whose blocks are on the GPU
        self.cpu_block_tables: dict[str, list[int]] = {}  # requests swapped out to the CPU
        # prefix caching: content hashes of each request's full, computed blocks, in order
        self.block_hashes: dict[str, list[int]] = {}
        self.num_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hits = 0  # of those, tokens found cached
        self._anonymous_ids = (f"anonymous-{i}" for i in itertools.count())

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _fit(
        self, num_needed: int, watermark: int, num_from_free: int | None = None
    ) -> AllocStatus:
        """NEVER if `num_needed` blocks exceed the pool; OK if `num_from_free` are free now."""
        if self.num_gpu_blocks - num_needed < watermark:
            return AllocStatus.NEVER
        num_from_free = num_needed if num_from_free is None else num_from_free
        if self.gpu_pool.num_free - num_from_free >= watermark:
            return AllocStatus.OK
        return AllocStatus.LATER

    # -- prefix cache ------------------------------------------------------------------------

    def _block_key(
        self, seq: Sequence, index: int, parent: int | None
    ) -> tuple[int, tuple[int, ...]]:
        """(content hash, token ids) of full block `index`; the salt and the adapter seed the
        chain. Ints and tuples of ints hash alike in every process, so replicas name a prefix
        alike."""
        tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
        root = chain_root(seq.cache_salt, seq.lora_int_id)
        return hash((parent if index else root, tokens)), tokens

    def _match_prefix(self, seq: Sequence, use_cache: bool = True) -> list[int]:
        """Cached blocks holding `seq`'s longest prefix of full blocks (one token always left)."""
        if not self.enable_caching or not use_cache:
            return []
        blocks: list[int] = []
        parent = None
        for index in range((seq.num_tokens - 1) // self.block_size):
            content_hash, tokens = self._block_key(seq, index, parent)
            block = self.gpu_pool.lookup(content_hash, tokens)
            if block is None:
                break
            blocks.append(block)
            parent = content_hash
        return blocks

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Index `seq`'s blocks that became full with computed K/V, for later prefix hits."""
        if not self.enable_caching:
            return
        hashes = self.block_hashes.setdefault(seq.request_id, [])
        if len(hashes) == num_computed_tokens // self.block_size:
            return  # no block filled up (a decode step, all but one in `block_size`)
        table = self.block_tables[seq.request_id]
        parent = hashes[-1] if hashes else None
        namespace = salt_namespace(seq.cache_salt)
        for index in range(len(hashes), num_computed_tokens // self.block_size):
            content_hash, tokens = self._block_key(seq, index, parent)
            self.gpu_pool.register(table[index], content_hash, tokens, parent, namespace)
            hashes.append(content_hash)
            parent = content_hash

    def take_kv_events(self) -> list[KvEvent]:
        """What the prefix cache stored, removed or cleared since the last call, in order."""
        return self.kv_events.take() if self.kv_events is not None else []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (a CLEARED event), if no request holds a block;
        whether it did (vLLM's `reset_prefix_cache`)."""
        return self.gpu_pool.reset_cache()

    # -- admission ---------------------------------------------------------------------------

    def can_allocate(
        self, seq: Sequence | int, is_resumed: bool = False, use_cache: bool = True
    ) -> AllocStatus:
        """Whether `seq`'s tokens (or a number of blocks) fit now, later, or never.

        The watermark keeps new requests from taking the last blocks that running ones grow
        into. A request resumed after preemption (`is_resumed`) may have grown into them
        already, so it only needs the blocks themselves; otherwise it could never come back.
        `use_cache=False` computes every token (prompt logprobs need each position's logits).
        """
        watermark = 0 if is_resumed else self.watermark_blocks
        if isinstance(seq, int):
            return self._fit(seq, watermark)
        hits = self._match_prefix(seq, use_cache)
        # a cached block nobody holds sits in the free queue: reusing it takes a free block too
        num_idle_hits = sum(1 for block in hits if self.gpu_pool.is_idle(block))
        num_needed = self.num_blocks_for(seq.num_tokens)
        return self._fit(num_needed, watermark, num_needed - len(hits) + num_idle_hits)

    def allocate(self, seq: Sequence | int, use_cache: bool = True) -> BlockTable:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks; return its table.

        With a token count instead, the blocks go to a new anonymous sequence (no tokens, so
        no prefix cache) that holds them until its table is passed to `free`.
        """
        if isinstance(seq, int):
            return self._allocate_anonymous(seq)
        assert seq.request_id not in self.block_tables, f"{seq.request_id} already allocated"
        hits = self._match_prefix(seq, use_cache)
        for block in hits:  # taken before allocating, so allocation cannot evict them
            self.gpu_pool.take(block)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        table = BlockTable(
            hits + [self.gpu_pool.allocate() for _ in range(num_new)],
            seq.request_id,
            num_cached_tokens=len(hits) * self.block_size,
        )
        self.block_tables[seq.request_id] = table
        if self.enable_caching:
            self.block_hashes[seq.request_id] = [self.gpu_pool.block_hash[b] or 0 for b in hits]
            self.num_cache_queries += seq.num_tokens
            self.num_cache_hits += table.num_cached_tokens
        return table

    def _allocate_anonymous(self, num_tokens: int) -> BlockTable:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        num_blocks = self.num_blocks_for(num_tokens)
        if num_blocks > self.gpu_pool.num_free:  # all or nothing: no half-made table to leak
            raise NoFreeBlocksError(
                f"{num_tokens} tokens need {num_blocks} blocks, {self.gpu_pool.num_free} are free"
            )
        request_id = next(self._anonymous_ids)
        while request_id in self.block_tables or request_id in self.cpu_block_tables:
            request_id = next(self._anonymous_ids)
        table = BlockTable((self.gpu_pool.allocate() for _ in range(num_blocks)), request_id)
        self.block_tables[request_id] = table
        return table

    # -- growth and sharing ------------------------------------------------------------------

    def _num_blocks_to_grow(
        self,
        seqs: Iterable[Sequence],
        tables: dict[str, list[int]],
        ref_count: Callable[[int], int],
        num_lookahead: int = 0,
    ) -> int:
        """Blocks `seqs` take from the pool to write from their first uncomputed slot on
        (through `num_lookahead` slots past their last token: speculative drafts).

        One per missing logical block, and a private copy of each shared block written to,
        except for its last writer, who holds it alone by then (`ref_count`: holders now).
        """
        # plain loops: this runs for every running request every step
        num_new = 0  # blocks for new logical blocks, then for private copies
        shared_writes: dict[int, int] = {}  # shared block -> how many of `seqs` write into it
        for seq in seqs:
            table = tables[seq.request_id]
            num_needed = self.num_blocks_for(seq.num_tokens + num_lookahead)
            num_new += max(0, num_needed - len(table))
            # (never RELEASED: a window only releases blocks before the first written slot)
            for block in table[seq.num_computed_tokens // self.block_size :]:
                if ref_count(block) > 1:
                    shared_writes[block] = shared_writes.get(block, 0) + 1
        for block, num_writers in shared_writes.items():
            num_new += min(num_writers, ref_count(block) - 1)
        return num_new

    def can_append_slot(self, *seqs: Sequence, num_lookahead: int = 0) -> bool:
        """Whether the tables of `seqs` can all grow at once to cover their tokens, and
        `num_lookahead` slots more each (for speculative drafts).

        Writing starts at each one's first uncomputed slot; a shared block there needs a
        private copy first (copy-on-write).
        """
        ref_count = self.gpu_pool.ref_counts.__getitem__
        num_needed = self._num_blocks_to_grow(seqs, self.block_tables, ref_count, num_lookahead)
        return num_needed <= self.gpu_pool.num_free

    def append_decode_slot(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """`can_append_slot` and `append_slot` at once for a sequence with one token to
        compute (a decode), the common case of every step: its copy-on-write pairs, or None,
        changing nothing, when it needs a block and none is free."""
        table = self.block_tables[seq.request_id]
        index = seq.num_computed_tokens // self.block_size  # the block the token goes to
        pool = self.gpu_pool
        if self.sliding_window is not None or len(table) > index + 1:
            return self.append_slot(seq) if self.can_append_slot(seq) else None
        if len(table) == index:  # the last block is full
            if not pool.num_free:
                return None
            table.append(pool.allocate())
            return []
        block = table[index]
        if pool.ref_counts[block] == 1:
            return []
        if not pool.num_free:
            return None
        table[index] = pool.allocate()
        pool.decref(block)
        return [(block, table[index])]

    def append_slot(self, seq: Sequence, num_lookahead: int = 0) -> list[tuple[int, int]]:
        """Grow the table to cover every token and `num_lookahead` slots more (speculative
        drafts, given back by `trim` once checked); return copy-on-write (src, dst) pairs."""
        start = seq.num_computed_tokens
        table = self.block_tables[seq.request_id]
        if self.sliding_window is not None:
            self._release_outside_window(table, start, self.gpu_pool)
        copies = []
        for i in range(start // self.block_size, len(table)):
            block = table[i]
            if self.gpu_pool.ref_counts[block] > 1:
                table[i] = self.gpu_pool.allocate()
                self.gpu_pool.decref(block)
                copies.append((block, table[i]))
        while len(table) < self.num_blocks_for(seq.num_tokens + num_lookahead):
            table.append(self.gpu_pool.allocate())
        return copies

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq`'s last token: the rejected drafts' lookahead slots.

        They were allocated for this sequence alone and never indexed (the prefix cache only
        hashes computed blocks of accepted tokens), so they go back to the pool as they are.
        """
        table = self.block_tables[seq.request_id]
        num_needed = self.num_blocks_for(seq.num_tokens)
        while len(table) > num_needed:
            self.gpu_pool.decref(table.pop())

    def _first_visible_block(self, first_query_pos: int) -> int:
        """The first logical block a query from `first_query_pos` on can see."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_pos - self.sliding_window + 1) // self.block_size

    def _release_outside_window(
        self, table: list[int], first_query_pos: int, pool: BlockPool
    ) -> None:
        """Free blocks no query from `first_query_pos` on can see; their entries become
        RELEASED, so memory stays bounded by the window as the sequence grows."""
        for i in range(min(len(table), self._first_visible_block(first_query_pos))):
            if table[i] != RELEASED:
                pool.decref(table[i])
                table[i] = RELEASED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks, shared; a later write copies (copy-on-write)."""
        table = list(self.block_tables[parent.request_id])
        for block in live(table):
            self.gpu_pool.incref(block)
        self.block_tables[child.request_id] = table
        if parent.request_id in self.block_hashes:
            self.block_hashes[child.request_id] = list(self.block_hashes[parent.request_id])

    # -- swapping ----------------------------------------------------------------------------
    # Requests swap as a group (the samples of one request): a block they share moves once and
    # stays shared on the other side, so swapping never costs a group its sharing.

    def _blocks_to_move(self, seqs: Iterable[Sequence], tables: dict[str, list[int]]) -> list[int]:
        """The blocks of `seqs` a swap moves: all but those outside a sliding window, which
        are released instead (moving them would be wasted, and releasing a block right after
        swapping it in would let another swap in the same step reuse it)."""
        return [
            block
            for seq in seqs
            for block in live(
                tables[seq.request_id][self._first_visible_block(seq.num_computed_tokens) :]
            )
        ]

    def can_swap_out(self, *seqs: Sequence) -> bool:
        """Whether the CPU pool has room for the blocks of `seqs`, each shared block once."""
        return len(set(self._blocks_to_move(seqs, self.block_tables))) <= self.cpu_pool.num_free

    def swap_out(self, *seqs: Sequence) -> list[tuple[int, int]]:
        """Move the blocks of `seqs` to the CPU pool; return (gpu, cpu) pairs to copy."""
        return self._move(
            seqs, self.block_tables, self.cpu_block_tables, self.gpu_pool, self.cpu_pool
        )

    def can_swap_in(self, *seqs: Sequence) -> AllocStatus:
        """Like `can_allocate` for resumed requests (no watermark, see there): room for the
        blocks of `seqs`, each shared block once, and for what they write next step."""
        ref_counts = Counter(self._blocks_to_move(seqs, self.cpu_block_tables))
        num_grow = self._num_blocks_to_grow(seqs, self.cpu_block_tables, ref_counts.__getitem__)
        return self._fit(len(ref_counts) + num_grow, watermark=0)

    def swap_in(self, *seqs: Sequence) -> list[tuple[int, int]]:
        """Move the blocks of `seqs` back to the GPU pool; return (cpu, gpu) pairs to copy."""
        pairs = self._move(
            seqs, self.cpu_block_tables, self.block_tables, self.cpu_pool, self.gpu_pool
        )
        for seq in seqs:
            # the new device blocks hold the same content: index them again
            hashes = self.block_hashes.pop(seq.request_id, [])
            self.mark_computed(seq, len(hashes) * self.block_size)
        return pairs

    def _move(
        self,
        seqs: Iterable[Sequence],
        src_tables: dict[str, list[int]],
        dst_tables: dict[str, list[int]],
        src_pool: BlockPool,
        dst_pool: BlockPool,
    ) -> list[tuple[int, int]]:
        moved: dict[int, int] = {}  # src block -> its dst copy, shared like the src was
        for seq in seqs:
            src_table = src_tables.pop(seq.request_id)
            self._release_outside_window(src_table, seq.num_computed_tokens, src_pool)
            for block in live(src_table):
                if block in moved:
                    dst_pool.incref(moved[block])
                else:
                    moved[block] = dst_pool.allocate()
                src_pool.decref(block)
            dst_tables[seq.request_id] = [moved.get(block, RELEASED) for block in src_table]
        return list(moved.items())

    # -- release and queries -----------------------------------------------------------------

    def free(self, seq: HasId) -> None:
        """Release every block `seq` (a request or a `BlockTable`) holds, wherever it is;
        unknown requests are a no-op."""
        self.block_hashes.pop(seq.request_id, None)
        for tables, pool in (
            (self.block_tables, self.gpu_pool),
            (self.cpu_block_tables, self.cpu_pool),
        ):
            # tail first: freed blocks are evicted in order, and a chain's tail is least useful
            for block in reversed(live(tables.pop(seq.request_id, []))):
                pool.decref(block)

    def has_blocks(self, seq: HasId) -> bool:
        return seq.request_id in self.block_tables or seq.request_id in self.cpu_block_tables

    def get_block_table(self, seq: HasId) -> list[int]:
        return self.block_tables[seq.request_id]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_pool.num_free

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free

    def usage(self) -> float:
        """block_usage_ratio: the fraction of GPU blocks in use."""
        return 1.0 - self.gpu_pool.num_free / self.num_gpu_blocks if self.num_gpu_blocks else 0.0

    def cpu_usage(self) -> float:
        return 1.0 - self.cpu_pool.num_free / self.num_cpu_blocks if self.num_cpu_blocks else 0.0

    def check_invariants(self) -> None:
        """Assert that every pool's free + referenced = total and ref counts match the tables."""
        for tables, pool in (
            (self.block_tables, self.gpu_pool),
            (self.cpu_block_tables, self.cpu_pool),
        ):
            holders: Counter[int] = Counter()
            for table in tables.values():
                holders.update(live(table))
            pool.check_invariants(holders)
        both = self.block_tables.keys() & self.cpu_block_tables.keys()
        assert not both, f"requests on both devices: {sorted(both)}"
