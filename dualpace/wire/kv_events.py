"""Conversions for the Engine service's WatchKvEvents: dualpace.kv.events <-> protobuf."""

from __future__ import annotations

from dualpace.kv.events import ALL_CLEARED, REMOVED, STORED, KvEvent
from dualpace.wire.v1 import engine_pb2


def kv_event_to_pb(event: KvEvent) -> engine_pb2.KvEvent:
    message = engine_pb2.KvEvent(event_id=event.event_id)
    if event.kind == STORED:
        message.stored.CopyFrom(engine_pb2.KvBlockStored(
            block_hashes=list(event.block_hashes), token_ids=list(event.token_ids), block_size=event.block_size,
            medium=event.medium))
        if event.parent_block_hash is not None:
            message.stored.parent_block_hash = event.parent_block_hash
    elif event.kind == REMOVED:
        message.removed.CopyFrom(engine_pb2.KvBlockRemoved(block_hashes=list(event.block_hashes),
                                                           medium=event.medium))
    elif event.kind == ALL_CLEARED:
        message.all_cleared.CopyFrom(engine_pb2.KvAllBlocksCleared(medium=event.medium))
    else:
        raise ValueError(f"unknown KV event kind {event.kind!r}")
    return message


def kv_event_batch_to_pb(events: list[KvEvent], engine: str) -> engine_pb2.KvEventBatch:
    return engine_pb2.KvEventBatch(events=[kv_event_to_pb(e) for e in events], engine=engine)


def kv_event_from_pb(message: engine_pb2.KvEvent) -> KvEvent:
    kind = message.WhichOneof("kind")
    if kind == "stored":
        stored = message.stored
        return KvEvent(message.event_id, STORED, tuple(stored.block_hashes),
                       stored.parent_block_hash if stored.HasField("parent_block_hash") else None,
                       tuple(stored.token_ids), stored.block_size, stored.medium)
    if kind == "removed":
        return KvEvent(message.event_id, REMOVED, tuple(message.removed.block_hashes), medium=message.removed.medium)
    if kind == "all_cleared":
        return KvEvent(message.event_id, ALL_CLEARED, medium=message.all_cleared.medium)
    raise ValueError("KvEvent: no kind set")


def watch_kv_events_request_to_pb() -> engine_pb2.WatchKvEventsRequest:
    return engine_pb2.WatchKvEventsRequest()


def kv_event_batch_from_pb(batch: engine_pb2.KvEventBatch, default_engine: str) -> tuple[str, list[KvEvent]]:
    """(the engine that sent it, its events)."""
    return batch.engine or default_engine, [kv_event_from_pb(e) for e in batch.events]
