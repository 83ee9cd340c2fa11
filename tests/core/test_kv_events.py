"""KV-cache events from the block manager: stored when the prefix cache indexes a block,
removed when it leaves the index, cleared on a reset; bounded when nobody takes them."""

from __future__ import annotations

import os
import subprocess
import sys

from asyncengine.core.block_manager import BlockSpaceManager
from asyncengine.core.kv_events import CLEARED, KvEvent, KvEventKind, KvEventLog
from tests.core.test_prefix_cache import BS, Seq, run_prefill

STORED, REMOVED = KvEventKind.STORED, KvEventKind.REMOVED


def create_block_manager(num_gpu_blocks: int = 8) -> BlockSpaceManager:
    return BlockSpaceManager(
        BS, num_gpu_blocks, 8, watermark=0.0, enable_caching=True, enable_kv_events=True
    )


def test_each_full_block_is_stored_once_in_chain_order_with_its_parent():
    bm = create_block_manager()
    prompt = list(range(100, 108))  # two full blocks, then a partial one
    run_prefill(bm, Seq("a", [*prompt, 1, 2]))
    first, second = bm.take_kv_events()
    assert (first.kind, second.kind) == (STORED, STORED)
    assert (first.token_ids, second.token_ids) == (tuple(prompt[:4]), tuple(prompt[4:]))
    assert (first.parent_hash, second.parent_hash) == (None, first.block_hash)
    assert bm.block_hashes["a"] == [first.block_hash, second.block_hash]
    # a hit stores nothing new, and taking empties the log
    run_prefill(bm, Seq("b", [*prompt, 9]))
    assert bm.take_kv_events() == []


def test_an_evicted_block_is_removed_and_a_freed_one_is_not():
    bm = create_block_manager(num_gpu_blocks=3)
    run_prefill(bm, Seq("a", [*range(10, 18), 1]))  # two cached blocks and a partial one
    stored = [e.block_hash for e in bm.take_kv_events()]
    bm.free(Seq("a", []))
    assert bm.take_kv_events() == []  # freed blocks stay cached
    run_prefill(bm, Seq("b", [*range(50, 54), 1]))  # needs two blocks: evicts the tail first
    events = bm.take_kv_events()
    assert [(e.kind, e.block_hash) for e in events if e.kind is REMOVED] == [(REMOVED, stored[1])]
    assert [e.token_ids for e in events if e.kind is STORED] == [tuple(range(50, 54))]


def test_a_swapped_in_copy_of_a_still_cached_block_stores_nothing_new():
    bm = create_block_manager()
    seq = Seq("a", [*range(20, 28), 1])
    run_prefill(bm, seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.take_kv_events()
    bm.swap_out(seq)
    bm.swap_in(seq)
    bm.check_invariants()
    assert bm.take_kv_events() == []


def test_reset_clears_everything_but_only_when_no_block_is_held():
    bm = create_block_manager()
    run_prefill(bm, Seq("a", [*range(30, 38), 1]))
    bm.take_kv_events()
    assert not bm.reset_prefix_cache()  # "a" still holds its blocks
    bm.free(Seq("a", []))
    assert bm.reset_prefix_cache()
    assert bm.take_kv_events() == [CLEARED]
    assert run_prefill(bm, Seq("b", [*range(30, 38), 1])) == 0  # nothing left to hit


def test_salted_chains_name_the_salt_by_a_digest_and_hash_apart():
    bm = create_block_manager()
    run_prefill(bm, Seq("a", [*range(40, 44), 1], cache_salt="tenant-secret"))
    run_prefill(bm, Seq("b", [*range(40, 44), 1]))
    salted, plain = bm.take_kv_events()
    assert salted.block_hash != plain.block_hash and plain.cache_salt is None
    assert salted.cache_salt is not None and "tenant-secret" not in salted.cache_salt


def test_block_hashes_are_the_same_in_another_process_so_replicas_name_prefixes_alike():
    script = (
        "from asyncengine.core.block_manager import BlockSpaceManager\n"
        "from tests.core.test_prefix_cache import Seq, run_prefill\n"
        "bm = BlockSpaceManager(4, 8, 8, watermark=0.0, enable_caching=True)\n"
        "run_prefill(bm, Seq('a', [1, 2, 3, 4, 5], cache_salt='s'))\n"
        "print(bm.block_hashes['a'][0])\n"
    )
    hashes = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    assert len(hashes) == 1, hashes
    assert -(2**63) <= int(hashes.pop()) < 2**63  # smg's int64 block_hash


def test_without_kv_events_nothing_is_recorded():
    bm = BlockSpaceManager(BS, 8, 8, watermark=0.0, enable_caching=True)
    run_prefill(bm, Seq("a", [*range(60, 68), 1]))
    assert bm.take_kv_events() == []


def test_a_log_nobody_takes_stays_bounded_and_says_it_lost_track():
    log = KvEventLog(max_events=4)
    for i in range(10):
        log.append(KvEvent(STORED, block_hash=i))
    events = log.take()
    assert len(events) <= 5 and events[0] == CLEARED
    assert [e.block_hash for e in events[1:]] == list(range(10 - len(events) + 1, 10))
