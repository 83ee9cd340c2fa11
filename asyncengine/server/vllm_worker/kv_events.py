"""The engine's KV event batches as smg's `KvEventBatch` messages (common.proto).

A block's hash is the engine's own (a signed 64-bit int naming the block and its whole prefix);
the gateway hashes the block's token ids itself to match a request, and learns the block size
from `KvBlock.block_size`. Consecutive stores of one chain travel as one `KvBlocksStored`.
"""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as pb

from asyncengine.core.kv_events import KvEvent, KvEventKind
from asyncengine.engine.kv_events import KvEventBatch

_DEVICE = pb.KvCacheTier.KV_CACHE_TIER_DEVICE
_LOCAL = pb.KvCacheLocality.KV_CACHE_LOCALITY_LOCAL


def batch_message(batch: KvEventBatch, block_size: int) -> pb.KvEventBatch:
    message = pb.KvEventBatch(
        sequence_number=batch.sequence_number,
        timestamp=batch.timestamp,
        events=_events(batch.events, block_size, batch.sequence_number),
    )
    if batch.snapshot is not None:
        chunk = batch.snapshot
        message.snapshot.CopyFrom(
            pb.KvSnapshotChunk(index=chunk.index, count=chunk.count, blocks=chunk.num_blocks)
        )
    return message


def _events(
    events: tuple[KvEvent, ...], block_size: int, sequence_number: int
) -> list[pb.KvCacheEvent]:
    out: list[pb.KvCacheEvent] = []
    last: KvEvent | None = None  # the event the last message in `out` ends with
    for event in events:
        if event.kind is KvEventKind.STORED:
            if _continues(last, event):
                out[-1].stored.blocks.append(_block(event, block_size))
            else:
                out.append(pb.KvCacheEvent(stored=_stored(event, block_size)))
        elif event.kind is KvEventKind.REMOVED:
            if last is not None and last.kind is KvEventKind.REMOVED:
                out[-1].removed.block_hashes.append(event.block_hash)
            else:
                removed = pb.KvBlocksRemoved(
                    block_hashes=[event.block_hash], tier=_DEVICE, medium="GPU", locality=_LOCAL
                )
                out.append(pb.KvCacheEvent(removed=removed))
        else:
            out.append(pb.KvCacheEvent(cleared=pb.KvCacheCleared()))
        last = event
    for event_id, message in enumerate(out):
        # unique per engine life: the batch's number, then the message's place in it
        message.event_id = (sequence_number << 20) + event_id
    return out


def _continues(last: KvEvent | None, event: KvEvent) -> bool:
    return (
        last is not None
        and last.kind is KvEventKind.STORED
        and event.parent_hash == last.block_hash
        and event.cache_salt == last.cache_salt
    )


def _stored(event: KvEvent, block_size: int) -> pb.KvBlocksStored:
    stored = pb.KvBlocksStored(
        blocks=[_block(event, block_size)], tier=_DEVICE, medium="GPU", locality=_LOCAL
    )
    if event.parent_hash is not None:
        stored.parent_block_hash = event.parent_hash
    if event.cache_salt is not None:
        stored.cache_salt = event.cache_salt
    return stored


def _block(event: KvEvent, block_size: int) -> pb.KvBlock:
    return pb.KvBlock(block_hash=event.block_hash, token_ids=event.token_ids, block_size=block_size)
