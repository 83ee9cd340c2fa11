"""The paged KV cache's bookkeeping: block pools, per-request block tables, swap and fork.

No tensors here: blocks are integer ids; the worker owns the memory behind them and applies
the (src, dst) pairs this module returns for copies and swaps.
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import Protocol


class AllocStatus(enum.Enum):
    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once other requests free blocks
    NEVER = enum.auto()  # can never fit in this cache


class Sequence(Protocol):
    """What the block manager needs to know of a request."""

    request_id: str

    @property
    def num_tokens(self) -> int: ...


class NoFreeBlocksError(RuntimeError):
    """A pool was asked for a block it does not have (a scheduler bug, never user input)."""


class BlockPool:
    """A fixed set of blocks on one device: O(1) allocate and free, reference-counted."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # a stack: popping hands out low ids first, which keeps tests easy to read
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block = self._free.pop()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def check_invariants(self, holders: Counter[int]) -> None:
        """`holders[b]` = how many tables hold block b; it must equal b's reference count."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free list twice"
        for block, ref_count in enumerate(self.ref_counts):
            assert ref_count == holders.get(block, 0), (
                f"block {block}: ref_count {ref_count} but held by {holders.get(block, 0)} tables"
            )
            assert (ref_count == 0) == (block in free), f"block {block}: free list out of sync"
        assert self.num_free + sum(1 for r in self.ref_counts if r) == self.num_blocks


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
    ) -> None:
        if enable_caching:
            raise NotImplementedError("prefix caching is not implemented yet")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.sliding_window = sliding_window
        # keep a few blocks back from admissions so running requests can still grow
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_pool = BlockPool(num_gpu_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self.block_tables: dict[str, list[int]] = {}  # requests whose blocks are on the GPU
        self.cpu_block_tables: dict[str, list[int]] = {}  # requests swapped out to the CPU

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _fit(self, num_needed: int, watermark: int) -> AllocStatus:
        if self.num_gpu_blocks - num_needed < watermark:
            return AllocStatus.NEVER
        if self.gpu_pool.num_free - num_needed >= watermark:
            return AllocStatus.OK
        return AllocStatus.LATER

    # -- admission ---------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, is_resumed: bool = False) -> AllocStatus:
        """Whether `seq`'s tokens fit now, later, or never.

        The watermark keeps new requests from taking the last blocks that running ones grow
        into. A request resumed after preemption (`is_resumed`) may have grown into them
        already, so it only needs the blocks themselves; otherwise it could never come back.
        """
        watermark = 0 if is_resumed else self.watermark_blocks
        return self._fit(self.num_blocks_for(seq.num_tokens), watermark)

    def allocate(self, seq: Sequence) -> None:
        assert seq.request_id not in self.block_tables, f"{seq.request_id} already allocated"
        num_blocks = self.num_blocks_for(seq.num_tokens)
        self.block_tables[seq.request_id] = [self.gpu_pool.allocate() for _ in range(num_blocks)]

    # -- growth and sharing ------------------------------------------------------------------

    def _num_blocks_to_append(self, seq: Sequence, first_written: int) -> int:
        table = self.block_tables[seq.request_id]
        num_cow = sum(
            1 for b in table[first_written // self.block_size :] if self.gpu_pool.ref_counts[b] > 1
        )
        return max(0, self.num_blocks_for(seq.num_tokens) - len(table)) + num_cow

    def can_append_slot(self, seq: Sequence, num_computed_tokens: int | None = None) -> bool:
        """Whether the table can grow to cover every token of `seq`.

        `num_computed_tokens` (default: all but the last token) marks the first slot written
        this step; shared blocks from there on need a private copy.
        """
        start = seq.num_tokens - 1 if num_computed_tokens is None else num_computed_tokens
        return self._num_blocks_to_append(seq, start) <= self.gpu_pool.num_free

    def append_slot(
        self, seq: Sequence, num_computed_tokens: int | None = None
    ) -> list[tuple[int, int]]:
        """Grow the table to cover every token; return copy-on-write (src, dst) pairs."""
        start = seq.num_tokens - 1 if num_computed_tokens is None else num_computed_tokens
        table = self.block_tables[seq.request_id]
        copies = []
        for i in range(start // self.block_size, len(table)):
            block = table[i]
            if self.gpu_pool.ref_counts[block] > 1:
                table[i] = self.gpu_pool.allocate()
                self.gpu_pool.decref(block)
                copies.append((block, table[i]))
        while len(table) < self.num_blocks_for(seq.num_tokens):
            table.append(self.gpu_pool.allocate())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks, shared; a later write copies (copy-on-write)."""
        table = list(self.block_tables[parent.request_id])
        for block in table:
            self.gpu_pool.incref(block)
        self.block_tables[child.request_id] = table

    # -- swapping ----------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.block_tables[seq.request_id]) <= self.cpu_pool.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s blocks to the CPU pool; return (gpu, cpu) pairs to copy."""
        return self._move(
            seq, self.block_tables, self.cpu_block_tables, self.gpu_pool, self.cpu_pool
        )

    def can_swap_in(self, seq: Sequence) -> AllocStatus:
        """Like `can_allocate` for a resumed request: no watermark (see there)."""
        return self._fit(self.num_blocks_for(seq.num_tokens), watermark=0)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s blocks back to the GPU pool; return (cpu, gpu) pairs to copy."""
        return self._move(
            seq, self.cpu_block_tables, self.block_tables, self.cpu_pool, self.gpu_pool
        )

    @staticmethod
    def _move(
        seq: Sequence,
        src_tables: dict[str, list[int]],
        dst_tables: dict[str, list[int]],
        src_pool: BlockPool,
        dst_pool: BlockPool,
    ) -> list[tuple[int, int]]:
        src_table = src_tables.pop(seq.request_id)
        pairs = [(block, dst_pool.allocate()) for block in src_table]
        for block in src_table:
            src_pool.decref(block)
        dst_tables[seq.request_id] = [dst for _, dst in pairs]
        return pairs

    # -- release and queries -----------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release every block `seq` holds, wherever it is; unknown requests are a no-op."""
        for tables, pool in (
            (self.block_tables, self.gpu_pool),
            (self.cpu_block_tables, self.cpu_pool),
        ):
            for block in tables.pop(seq.request_id, ()):
                pool.decref(block)

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.request_id in self.block_tables or seq.request_id in self.cpu_block_tables

    def get_block_table(self, seq: Sequence) -> list[int]:
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
                holders.update(table)
            pool.check_invariants(holders)
        both = self.block_tables.keys() & self.cpu_block_tables.keys()
        assert not both, f"requests on both devices: {sorted(both)}"
