"""The engine's KV-event stream: sequence numbers, resuming from the history, a snapshot for a
new or resynced subscriber, a bounded queue for a slow one, and engine.kv_events() in Python."""

from __future__ import annotations

import asyncio

import pytest

from asyncengine import AsyncLLMEngine, EngineArgs, SamplingParams
from asyncengine.core.kv_events import CLEARED, KvEvent, KvEventKind
from asyncengine.engine.kv_events import KvEventBatch, KvEventHub, KvEventSubscription

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STORED, REMOVED = KvEventKind.STORED, KvEventKind.REMOVED


def stored(block_hash: int, parent: int | None = None) -> KvEvent:
    return KvEvent(STORED, block_hash, parent, (block_hash,) * 4)


async def take(subscription: KvEventSubscription, n: int) -> list[KvEventBatch]:
    return [await asyncio.wait_for(anext(subscription), 10) for _ in range(n)]


def test_batches_are_numbered_and_a_new_subscriber_starts_from_a_snapshot() -> None:
    async def main() -> None:
        hub = KvEventHub()
        hub.publish([stored(1), stored(2, 1)])
        hub.publish([KvEvent(REMOVED, 2), stored(3, 1)])
        async with hub.subscribe() as sub:
            (snapshot,) = await take(sub, 1)
            # numbered with the last batch: the live ones continue after it, no gap
            assert snapshot.sequence_number == 2 and snapshot.snapshot is not None
            assert snapshot.events[0] == CLEARED
            assert [e.block_hash for e in snapshot.events[1:]] == [1, 3]  # parents first
            hub.publish([stored(4, 3)])
            (live,) = await take(sub, 1)
            assert live.sequence_number == 3 and live.snapshot is None

    asyncio.run(main())


def test_a_subscriber_resumes_from_the_history_or_resyncs_when_it_is_gone() -> None:
    async def main() -> None:
        hub = KvEventHub(history_len=3)
        for i in range(1, 6):
            hub.publish([stored(i)])
        async with hub.subscribe(start_sequence_number=3) as sub:
            assert [b.sequence_number for b in await take(sub, 2)] == [4, 5]
        async with hub.subscribe(start_sequence_number=1) as sub:  # 2 is no longer kept
            (snapshot,) = await take(sub, 1)
            assert snapshot.snapshot is not None and snapshot.sequence_number == 5
        async with hub.subscribe(start_sequence_number=99) as sub:  # the engine restarted
            assert (await take(sub, 1))[0].events[0] == CLEARED

    asyncio.run(main())


def test_a_slow_subscriber_gets_a_bounded_queue_then_a_cleared_resync() -> None:
    async def main() -> None:
        hub = KvEventHub(queue_len=4)
        async with hub.subscribe() as slow, hub.subscribe() as fast:
            await take(slow, 1)
            await take(fast, 1)
            for i in range(1, 11):
                hub.publish([stored(i, i - 1 if i > 1 else None)])
                assert [b.sequence_number for b in await take(fast, 1)] == [i]
            assert slow.num_resyncs == 1 and fast.num_resyncs == 0
            (resync,) = await take(slow, 1)
            assert resync.sequence_number == 10 and resync.events[0] == CLEARED
            assert [e.block_hash for e in resync.events[1:]] == list(range(1, 11))
            hub.publish([KvEvent(REMOVED, 10)])
            assert [b.sequence_number for b in await take(slow, 1)] == [11]

    asyncio.run(main())


def test_a_large_snapshot_comes_in_chunks_numbered_up_to_the_last_batch() -> None:
    async def main() -> None:
        hub = KvEventHub(chunk_blocks=4)
        for i in range(1, 11):
            hub.publish([stored(i)])
        async with hub.subscribe() as sub:
            chunks = await take(sub, 3)
        assert [c.sequence_number for c in chunks] == [8, 9, 10]
        assert all(c.snapshot is not None and c.snapshot.count == 3 for c in chunks)
        assert sum(len(c.events) for c in chunks) == 1 + 10

    asyncio.run(main())


def test_engine_kv_events_in_python_and_the_stream_ends_with_the_engine(model_dir) -> None:
    args = EngineArgs(model=str(model_dir("llama")), device="cpu", dtype="float32",
                      block_size=8, enable_kv_events=True)  # fmt: skip
    prompt = list(range(5, 5 + 8 * 3 + 2))

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(args)
        sub = engine.kv_events()
        (snapshot,) = await take(sub, 1)
        assert snapshot.events == (CLEARED,)
        params = SamplingParams(max_tokens=1, temperature=0)
        async for _ in engine.generate({"prompt_token_ids": prompt}, params, request_id="a"):
            pass
        (batch,) = await take(sub, 1)
        assert [e.token_ids for e in batch.events] == [
            tuple(prompt[0:8]),
            tuple(prompt[8:16]),
            tuple(prompt[16:24]),
        ]
        # nothing holds a block now: the reset clears the cache, and says so to subscribers
        assert await engine.reset_prefix_cache()
        (cleared,) = await take(sub, 1)
        assert cleared.events == (CLEARED,) and cleared.sequence_number == batch.sequence_number + 1
        await engine.shutdown()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(sub), 10)

    asyncio.run(main())


def test_kv_events_off_by_default(model_dir) -> None:
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir("llama")), device="cpu", dtype="float32")
    )
    with pytest.raises(RuntimeError, match="enable_kv_events"):
        engine.kv_events()
