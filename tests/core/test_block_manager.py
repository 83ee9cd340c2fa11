"""BlockSpaceManager: admission, growth, fork with copy-on-write, swapping and its own checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from asyncengine.core.block_manager import (
    RELEASED,
    AllocStatus,
    BlockSpaceManager,
    NoFreeBlocksError,
)


@dataclass
class Seq:
    """The little the block manager needs of a request; tests grow `num_tokens` by hand."""

    request_id: str
    num_tokens: int

    @property
    def num_computed_tokens(self) -> int:
        return self.num_tokens - 1  # decoding: only the newest token's K/V is missing


def create_block_manager(
    block_size: int = 4, num_gpu_blocks: int = 8, num_cpu_blocks: int = 8, watermark: float = 0.0
) -> BlockSpaceManager:
    return BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark=watermark)


def allocated(bm: BlockSpaceManager, request_id: str, num_tokens: int) -> Seq:
    seq = Seq(request_id, num_tokens)
    assert bm.can_allocate(seq) is AllocStatus.OK
    bm.allocate(seq)
    bm.check_invariants()
    return seq


# -- admission ---------------------------------------------------------------------------------


def test_can_allocate_is_ok_when_it_fits_later_when_others_hold_blocks_never_when_too_big():
    bm = create_block_manager(num_gpu_blocks=8)
    assert bm.can_allocate(Seq("whole-cache", 32)) is AllocStatus.OK
    assert bm.can_allocate(Seq("one-too-many", 33)) is AllocStatus.NEVER

    allocated(bm, "holder", 20)  # 5 blocks
    assert bm.can_allocate(Seq("fits", 12)) is AllocStatus.OK
    assert bm.can_allocate(Seq("later", 13)) is AllocStatus.LATER
    assert bm.can_allocate(Seq("never", 33)) is AllocStatus.NEVER


def test_watermark_keeps_blocks_back_from_admission():
    bm = create_block_manager(num_gpu_blocks=10, watermark=0.2)
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(Seq("leaves-watermark", 32)) is AllocStatus.OK  # 8 blocks
    assert bm.can_allocate(Seq("eats-watermark", 33)) is AllocStatus.NEVER  # 9 blocks

    allocated(bm, "holder", 4)
    assert bm.can_allocate(Seq("now-later", 32)) is AllocStatus.LATER
    assert bm.can_allocate(Seq("still-fits", 28)) is AllocStatus.OK


def test_a_resumed_request_only_needs_the_blocks_not_the_watermark():
    bm = create_block_manager(num_gpu_blocks=10, watermark=0.2)
    allocated(bm, "holder", 4)
    grown = Seq("grown-into-the-watermark", 36)  # 9 blocks: all that the holder leaves
    assert bm.can_allocate(grown) is AllocStatus.NEVER
    assert bm.can_allocate(grown, is_resumed=True) is AllocStatus.OK
    assert bm.can_allocate(Seq("too-big", 41), is_resumed=True) is AllocStatus.NEVER

    swapped = allocated(bm, "swapped", 8)
    bm.swap_out(swapped)
    swapped.num_tokens = 36
    assert bm.can_swap_in(swapped) is AllocStatus.OK


def test_allocate_covers_every_token_and_free_returns_every_block():
    bm = create_block_manager(num_gpu_blocks=8)
    a = allocated(bm, "a", 9)
    b = allocated(bm, "b", 4)
    assert len(bm.get_block_table(a)) == 3 and len(bm.get_block_table(b)) == 1
    assert set(bm.get_block_table(a)).isdisjoint(bm.get_block_table(b))
    assert bm.get_num_free_gpu_blocks() == 4

    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 8
    assert not bm.has_blocks(a) and not bm.block_tables


def test_free_of_an_unknown_request_is_a_no_op():
    bm = create_block_manager()
    bm.free(Seq("never-seen", 5))
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


def test_allocating_from_an_empty_pool_raises():
    bm = create_block_manager(num_gpu_blocks=2)
    allocated(bm, "a", 8)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(Seq("b", 1))


def test_only_ok_is_true_so_if_can_allocate_reads_right():
    assert AllocStatus.OK
    assert not AllocStatus.LATER
    assert not AllocStatus.NEVER


def test_can_allocate_takes_a_block_count_with_the_same_answers_and_watermark():
    bm = create_block_manager(num_gpu_blocks=10, watermark=0.2)  # 2 blocks held back
    assert bm.can_allocate(8) is AllocStatus.OK
    assert bm.can_allocate(9) is AllocStatus.NEVER
    allocated(bm, "holder", 4)  # 1 block
    assert bm.can_allocate(8) is AllocStatus.LATER
    assert bm.can_allocate(7) is AllocStatus.OK
    assert bm.can_allocate(9, is_resumed=True) is AllocStatus.OK


def test_allocate_returns_the_live_block_table_and_free_takes_it_back():
    bm = create_block_manager(num_gpu_blocks=8)
    seq = Seq("a", 5)
    table = bm.allocate(seq)
    assert table == bm.get_block_table(seq) and len(table) == 2
    assert table.request_id == "a" and table.num_cached_tokens == 0
    seq.num_tokens = 9
    bm.append_slot(seq)
    assert len(table) == 3  # the manager's own table, not a copy
    bm.free(table)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 8 and not bm.has_blocks(seq)


def test_allocate_with_a_token_count_holds_blocks_for_an_anonymous_sequence():
    bm = create_block_manager(block_size=4, num_gpu_blocks=8)
    first = bm.allocate(9)
    second = bm.allocate(4)
    assert (len(first), len(second)) == (3, 1)
    assert set(first).isdisjoint(second) and first.request_id != second.request_id
    assert bm.get_block_table(first) == first
    assert bm.get_num_free_gpu_blocks() == 4
    bm.check_invariants()
    bm.free(first)
    bm.free(second)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 8 and not bm.block_tables


def test_allocate_with_too_many_tokens_raises_and_holds_nothing():
    bm = create_block_manager(block_size=4, num_gpu_blocks=2)
    with pytest.raises(NoFreeBlocksError, match="3 blocks"):
        bm.allocate(9)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 2 and not bm.block_tables
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate(-1)


# -- growth --------------------------------------------------------------------------------------


def test_append_slot_adds_a_block_only_when_a_token_crosses_a_block_boundary():
    bm = create_block_manager(num_gpu_blocks=4)
    seq = allocated(bm, "a", 3)
    assert len(bm.get_block_table(seq)) == 1

    seq.num_tokens = 4  # fills the first block
    assert bm.can_append_slot(seq)
    assert bm.append_slot(seq) == []
    assert len(bm.get_block_table(seq)) == 1

    seq.num_tokens = 5  # first token of a second block
    assert bm.append_slot(seq) == []
    assert len(bm.get_block_table(seq)) == 2
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 2


def test_can_append_slot_is_false_when_the_pool_is_full():
    bm = create_block_manager(num_gpu_blocks=2)
    seq = allocated(bm, "a", 8)
    seq.num_tokens = 9
    assert not bm.can_append_slot(seq)


# -- fork and copy-on-write ---------------------------------------------------------------------


def test_fork_shares_every_block_and_counts_both_holders():
    bm = create_block_manager(num_gpu_blocks=8)
    parent = allocated(bm, "parent", 6)
    child = Seq("child", 6)
    bm.fork(parent, child)
    bm.check_invariants()
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert all(bm.gpu_pool.ref_counts[b] == 2 for b in bm.get_block_table(parent))
    assert bm.get_num_free_gpu_blocks() == 6


def test_append_slot_on_a_shared_last_block_copies_it_and_leaves_both_tables_valid():
    bm = create_block_manager(num_gpu_blocks=8)
    parent = allocated(bm, "parent", 6)  # blocks [0, 1], the last one half full
    child = Seq("child", 6)
    bm.fork(parent, child)
    shared_first, shared_last = bm.get_block_table(parent)

    child.num_tokens = 7  # the child writes slot 6, inside the shared last block
    assert bm.can_append_slot(child)
    copies = bm.append_slot(child)
    bm.check_invariants()

    (src, dst), *rest = copies
    assert not rest
    assert src == shared_last and dst not in (shared_first, shared_last)
    assert bm.get_block_table(child) == [shared_first, dst]
    assert bm.get_block_table(parent) == [shared_first, shared_last]
    assert bm.gpu_pool.ref_counts[shared_first] == 2
    assert bm.gpu_pool.ref_counts[shared_last] == bm.gpu_pool.ref_counts[dst] == 1

    # the parent is now the only holder of its last block: it writes in place
    parent.num_tokens = 7
    assert bm.append_slot(parent) == []
    assert bm.get_block_table(parent) == [shared_first, shared_last]

    bm.free(parent)
    bm.free(child)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 8


def test_can_append_slot_counts_the_copy_a_shared_block_needs():
    bm = create_block_manager(num_gpu_blocks=2)
    parent = allocated(bm, "parent", 2)
    child = Seq("child", 2)
    bm.fork(parent, child)
    allocated(bm, "filler", 4)  # the pool is now full
    child.num_tokens = 3
    assert not bm.can_append_slot(child)


@pytest.mark.parametrize(
    ("num_tokens", "forked", "num_gpu_blocks"),
    [
        (6, False, 8),  # the token lands in the last block, held alone: nothing to do
        (8, False, 8),  # the last block is full: one new block
        (6, True, 8),  # the last block is shared with a fork: a private copy
        (8, False, 2),  # a new block is needed and none is free (2 blocks hold 8 tokens)
        (6, True, 2),  # a copy is needed and none is free
    ],
)
def test_append_decode_slot_does_what_can_append_slot_and_append_slot_do(
    num_tokens, forked, num_gpu_blocks
):
    def setup() -> tuple[BlockSpaceManager, Seq]:
        bm = create_block_manager(num_gpu_blocks=num_gpu_blocks)
        seq = allocated(bm, "a", num_tokens)
        if forked:
            bm.fork(seq, Seq("fork", num_tokens))
        seq.num_tokens += 1
        return bm, seq

    general, general_seq = setup()
    fast, fast_seq = setup()
    expected = general.append_slot(general_seq) if general.can_append_slot(general_seq) else None
    assert fast.append_decode_slot(fast_seq) == expected
    fast.check_invariants()
    assert fast.block_tables == general.block_tables
    assert fast.get_num_free_gpu_blocks() == general.get_num_free_gpu_blocks()


# -- swapping -----------------------------------------------------------------------------------


def test_swap_out_then_in_moves_the_blocks_between_pools_and_returns_the_copies():
    bm = create_block_manager(num_gpu_blocks=8, num_cpu_blocks=8)
    other = allocated(bm, "other", 4)
    seq = allocated(bm, "a", 10)
    gpu_table = list(bm.get_block_table(seq))
    assert bm.can_swap_out(seq)

    out_pairs = bm.swap_out(seq)
    bm.check_invariants()
    assert [gpu for gpu, _ in out_pairs] == gpu_table
    assert bm.cpu_block_tables["a"] == [cpu for _, cpu in out_pairs]
    assert "a" not in bm.block_tables and bm.has_blocks(seq)
    assert bm.get_num_free_gpu_blocks() == 7 and bm.get_num_free_cpu_blocks() == 5

    assert bm.can_swap_in(seq) is AllocStatus.OK
    in_pairs = bm.swap_in(seq)
    bm.check_invariants()
    assert [cpu for cpu, _ in in_pairs] == [cpu for _, cpu in out_pairs]
    assert bm.get_block_table(seq) == [gpu for _, gpu in in_pairs]
    assert "a" not in bm.cpu_block_tables
    assert bm.get_num_free_gpu_blocks() == 4 and bm.get_num_free_cpu_blocks() == 8

    bm.free(seq)
    bm.free(other)
    assert bm.get_num_free_gpu_blocks() == 8


def test_can_swap_out_is_false_when_the_cpu_pool_is_too_small():
    bm = create_block_manager(num_gpu_blocks=8, num_cpu_blocks=2)
    assert not bm.can_swap_out(allocated(bm, "three-blocks", 12))
    assert bm.can_swap_out(allocated(bm, "two-blocks", 8))
    no_cpu = create_block_manager(num_cpu_blocks=0)
    assert not no_cpu.can_swap_out(allocated(no_cpu, "a", 1))


def test_can_swap_in_counts_the_block_the_next_token_needs():
    bm = create_block_manager(num_gpu_blocks=4)
    seq = allocated(bm, "a", 8)
    bm.swap_out(seq)
    seq.num_tokens = 9  # a token was sampled before the swap: it needs a third block
    allocated(bm, "filler", 8)
    assert bm.can_swap_in(seq) is AllocStatus.LATER
    seq.num_tokens = 17
    assert bm.can_swap_in(seq) is AllocStatus.NEVER


def forked_group(bm: BlockSpaceManager, num_samples: int, num_tokens: int) -> list[Seq]:
    """A request of `num_tokens` and `num_samples - 1` samples forked from it, all decoding."""
    group = [allocated(bm, "s0", num_tokens)]
    for i in range(1, num_samples):
        group.append(Seq(f"s{i}", num_tokens))
        bm.fork(group[0], group[-1])
    return group


def test_a_group_swaps_out_and_in_with_each_shared_block_moved_once_and_still_shared():
    bm = create_block_manager(num_gpu_blocks=8, num_cpu_blocks=8)
    group = forked_group(bm, 3, 6)  # blocks [0, 1] held by three tables
    gpu_table = list(bm.get_block_table(group[0]))
    assert bm.can_swap_out(*group)

    out_pairs = bm.swap_out(*group)
    bm.check_invariants()
    assert [gpu for gpu, _ in out_pairs] == gpu_table  # two copies, not six
    cpu_table = [cpu for _, cpu in out_pairs]
    assert all(bm.cpu_block_tables[s.request_id] == cpu_table for s in group)
    assert [bm.cpu_pool.ref_counts[b] for b in cpu_table] == [3, 3]
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 6

    in_pairs = bm.swap_in(*group)
    bm.check_invariants()
    assert [cpu for cpu, _ in in_pairs] == cpu_table
    new_table = [gpu for _, gpu in in_pairs]
    assert all(bm.get_block_table(s) == new_table for s in group)
    assert bm.get_num_free_gpu_blocks() == 6 and bm.get_num_free_cpu_blocks() == 8


def test_a_group_fits_the_cpu_pool_by_its_distinct_blocks():
    bm = create_block_manager(num_gpu_blocks=8, num_cpu_blocks=2)
    group = forked_group(bm, 4, 8)  # 2 distinct blocks, 8 block-table entries
    assert bm.can_swap_out(*group)
    assert not bm.can_swap_out(*group, allocated(bm, "other", 1))


def swapped_out_group(bm: BlockSpaceManager, num_samples: int) -> list[Seq]:
    """Samples of a 6-token prompt (2 blocks, the last half full), swapped out, each with a
    token sampled since: each writes slot 6, in the shared last block."""
    group = forked_group(bm, num_samples, 6)
    bm.swap_out(*group)
    for seq in group:
        seq.num_tokens = 7
    return group


def test_can_swap_in_counts_each_copy_the_group_will_write_and_no_more():
    # two samples decoding into their shared, half-full last block: the first to write copies
    # it, the second then holds it alone, so swapping in takes 2 blocks + 1 copy
    bm = create_block_manager(num_gpu_blocks=3)
    group = swapped_out_group(bm, 2)
    assert bm.can_swap_in(*group) is AllocStatus.OK
    bm.swap_in(*group)
    copies = [pair for seq in group for pair in bm.append_slot(seq)]
    bm.check_invariants()
    assert len(copies) == 1 and bm.get_num_free_gpu_blocks() == 0

    # three samples: two copies
    bm = create_block_manager(num_gpu_blocks=4)
    group = swapped_out_group(bm, 3)
    assert bm.can_swap_in(*group) is AllocStatus.OK
    filler = allocated(bm, "filler", 1)
    assert bm.can_swap_in(*group) is AllocStatus.LATER
    bm.free(filler)
    for seq in group:
        seq.num_tokens = 9  # each writes into a third block of its own: 2 + 3 > 4
    assert bm.can_swap_in(*group) is AllocStatus.NEVER


def test_can_append_slot_of_a_group_counts_its_shared_writes_together():
    bm = create_block_manager(num_gpu_blocks=4)
    group = forked_group(bm, 3, 6)
    for seq in group:
        seq.num_tokens = 7
    assert all(bm.can_append_slot(seq) for seq in group)  # one at a time: one copy each
    assert bm.can_append_slot(*group)  # all three: two copies, and 2 blocks are free
    allocated(bm, "filler", 1)
    assert bm.can_append_slot(group[0]) and not bm.can_append_slot(*group)


def test_a_sliding_window_swap_moves_only_the_blocks_the_window_still_sees():
    # blocks the window has left are released, not moved: swapping them in only to release
    # them would also free a block that another swap-in of the same step could be given
    bm = BlockSpaceManager(4, 8, 8, sliding_window=4, watermark=0.0)
    seq = allocated(bm, "a", 12)  # 3 blocks; its next query (position 11) sees 8..11 only
    gpu_table = list(bm.get_block_table(seq))
    out_pairs = bm.swap_out(seq)
    bm.check_invariants()
    assert [gpu for gpu, _ in out_pairs] == gpu_table[2:]
    assert bm.cpu_block_tables["a"][:2] == [RELEASED, RELEASED]
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 7

    assert bm.can_swap_in(seq) is AllocStatus.OK
    in_pairs = bm.swap_in(seq)
    assert len(in_pairs) == 1 and bm.append_slot(seq) == []
    bm.check_invariants()
    assert bm.get_block_table(seq)[:2] == [RELEASED, RELEASED]
    assert bm.get_num_free_gpu_blocks() == 7 and bm.get_num_free_cpu_blocks() == 8


def test_free_of_a_swapped_request_frees_its_cpu_blocks():
    bm = create_block_manager(num_cpu_blocks=4)
    seq = allocated(bm, "a", 7)
    bm.swap_out(seq)
    assert bm.get_num_free_cpu_blocks() == 2
    bm.free(seq)
    bm.check_invariants()
    assert bm.get_num_free_cpu_blocks() == 4 and bm.get_num_free_gpu_blocks() == 8
    assert not bm.has_blocks(seq)


# -- queries and self-checks --------------------------------------------------------------------


def test_usage_is_the_fraction_of_blocks_in_use():
    bm = create_block_manager(num_gpu_blocks=8, num_cpu_blocks=4)
    assert bm.usage() == 0.0 and bm.cpu_usage() == 0.0
    seq = allocated(bm, "a", 8)
    assert bm.usage() == 0.25
    bm.swap_out(seq)
    assert bm.usage() == 0.0 and bm.cpu_usage() == 0.5
    empty = create_block_manager(num_gpu_blocks=0, num_cpu_blocks=0)
    assert empty.usage() == 0.0 and empty.cpu_usage() == 0.0


def test_check_invariants_catches_a_corrupted_ref_count():
    bm = create_block_manager()
    seq = allocated(bm, "a", 5)
    bm.gpu_pool.ref_counts[bm.get_block_table(seq)[0]] += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_invariants()


def test_check_invariants_catches_a_block_held_by_two_tables_without_a_reference():
    bm = create_block_manager()
    seq = allocated(bm, "a", 4)
    bm.block_tables["b"] = list(bm.get_block_table(seq))  # shared without incref
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_a_request_on_both_devices():
    bm = create_block_manager()
    allocated(bm, "a", 4)
    bm.cpu_block_tables["a"] = [bm.cpu_pool.allocate()]
    with pytest.raises(AssertionError, match="both devices"):
        bm.check_invariants()
