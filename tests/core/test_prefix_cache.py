"""Prefix caching in the block manager: reuse by content, LRU eviction, salts, collisions."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from asyncengine.core.block_manager import AllocStatus, BlockSpaceManager

BS = 4


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = field(default=0)
    lora_int_id: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def create_block_manager(num_gpu_blocks: int = 8) -> BlockSpaceManager:
    return BlockSpaceManager(BS, num_gpu_blocks, 8, watermark=0.0, enable_caching=True)


def run_prefill(bm: BlockSpaceManager, seq: Seq) -> int:
    """Admit `seq`, 'compute' its prompt, and index its full blocks; return cached tokens."""
    assert bm.can_allocate(seq) is AllocStatus.OK
    num_cached = bm.allocate(seq).num_cached_tokens
    bm.mark_computed(seq, seq.num_tokens)
    bm.check_invariants()
    return num_cached


def test_a_shared_prefix_is_computed_once_and_its_blocks_shared():
    bm = create_block_manager()
    system = list(range(100, 108))  # two full blocks
    first = Seq("a", [*system, 1, 2, 3])
    second = Seq("b", [*system, 7, 8])
    assert run_prefill(bm, first) == 0
    assert run_prefill(bm, second) == 2 * BS
    assert bm.get_block_table(first)[:2] == bm.get_block_table(second)[:2]
    assert bm.get_block_table(first)[2] != bm.get_block_table(second)[2]
    assert [bm.gpu_pool.ref_counts[b] for b in bm.get_block_table(second)] == [2, 2, 1]
    assert (bm.num_cache_queries, bm.num_cache_hits) == (11 + 10, 8)


def test_freed_blocks_stay_cached_until_allocation_needs_them():
    bm = create_block_manager(num_gpu_blocks=4)
    prompt = list(range(50, 62))  # three full blocks
    run_prefill(bm, Seq("a", [*prompt, 1]))
    bm.free(Seq("a", []))
    assert bm.get_num_free_gpu_blocks() == 4
    # the finished request's blocks still serve a later request with the same prefix
    assert run_prefill(bm, Seq("b", [*prompt, 2])) == 3 * BS
    bm.free(Seq("b", []))
    # a request with no common prefix needs every block: the cached ones are evicted
    run_prefill(bm, Seq("c", list(range(200, 216))))
    bm.free(Seq("c", []))
    assert run_prefill(bm, Seq("d", [*prompt, 3])) == 0


def test_cached_blocks_in_the_free_queue_do_not_count_as_free_for_admission():
    bm = create_block_manager(num_gpu_blocks=4)
    prefix = list(range(10, 18))  # two full blocks
    run_prefill(bm, Seq("a", [*prefix, 1]))
    bm.free(Seq("a", []))
    holder = Seq("holder", list(range(300, 308)))  # holds two of the four blocks
    run_prefill(bm, holder)
    # the hit takes 2 cached blocks out of the free queue and needs 1 new one: 3 > 2 free
    assert bm.can_allocate(Seq("b", [*prefix, 1, 2, 3, 4, 5])) is AllocStatus.LATER
    assert bm.can_allocate(Seq("c", [*prefix, 1])) is AllocStatus.LATER
    bm.free(holder)
    assert bm.can_allocate(Seq("c", [*prefix, 1])) is AllocStatus.OK


def test_at_least_one_token_is_always_computed():
    bm = create_block_manager()
    prompt = list(range(20, 28))  # exactly two full blocks
    run_prefill(bm, Seq("a", prompt))
    assert run_prefill(bm, Seq("b", prompt)) == BS  # the last block is recomputed


def test_different_salts_never_share_blocks():
    bm = create_block_manager()
    prompt = list(range(30, 39))
    run_prefill(bm, Seq("a", prompt, cache_salt="tenant-1"))
    assert run_prefill(bm, Seq("b", prompt, cache_salt="tenant-2")) == 0
    assert run_prefill(bm, Seq("c", prompt, cache_salt="tenant-1")) == 2 * BS


def test_different_lora_adapters_never_share_blocks():
    bm = create_block_manager()
    prompt = list(range(30, 39))
    run_prefill(bm, Seq("a", prompt, lora_int_id=1))
    assert run_prefill(bm, Seq("b", prompt, lora_int_id=2)) == 0
    bm.free(Seq("b", []))
    assert run_prefill(bm, Seq("c", prompt)) == 0  # nor the base model with an adapter
    bm.free(Seq("c", []))
    assert run_prefill(bm, Seq("d", prompt, lora_int_id=1)) == 2 * BS


def test_a_hash_collision_never_returns_another_prefix():
    bm = create_block_manager()
    run_prefill(bm, Seq("a", list(range(40, 49))))
    block = bm.get_block_table(Seq("a", []))[0]
    content_hash = bm.gpu_pool.block_hash[block]
    assert content_hash is not None
    # same hash, other tokens: a lookup must not return the block
    assert bm.gpu_pool.lookup(content_hash, (1, 2, 3, 4)) is None
    assert bm.gpu_pool.lookup(content_hash, (40, 41, 42, 43)) == block


def test_swapped_in_blocks_are_indexed_again():
    bm = create_block_manager()
    prompt = list(range(60, 69))
    seq = Seq("a", prompt)
    run_prefill(bm, seq)
    bm.swap_out(seq)
    bm.swap_in(seq)
    bm.check_invariants()
    assert run_prefill(bm, Seq("b", prompt)) == 2 * BS


def test_sliding_window_models_cannot_use_prefix_caching():
    with pytest.raises(ValueError, match="sliding"):
        BlockSpaceManager(BS, 8, 8, sliding_window=32, enable_caching=True)
