"""WatchKvEvents for the Engine servicer: a snapshot, then the prefix cache's events as they come.

The event log lives in the scheduler, which the step thread mutates, so it is read only
through EngineLoop.call (between steps), every `poll_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dualpace.engine.loop import EngineLoop
from dualpace.errors import FailedPrecondition
from dualpace.kv.events import KvEvent
from dualpace.wire.kv_events import kv_event_batch_to_pb
from dualpace.wire.v1 import engine_pb2

DEFAULT_POLL_S = 0.05


async def watch_kv_events(loop: EngineLoop, poll_s: float = DEFAULT_POLL_S) -> AsyncIterator[engine_pb2.KvEventBatch]:
    log = loop.core.scheduler.prefix_cache.events if loop.core.scheduler.prefix_cache is not None else None
    if log is None:
        raise FailedPrecondition(f"engine {loop.core.config.name} runs with --prefix-caching off: no KV events")
    name = loop.core.config.name

    def snapshot() -> tuple[list[KvEvent], int]:
        return log.snapshot(), log.last_event_id

    events, last_id = await loop.call(snapshot)
    yield kv_event_batch_to_pb(events, name)
    while not loop.stopped.is_set():
        await asyncio.sleep(poll_s)
        try:
            events = await loop.call(lambda: log.since(last_id))
        except Exception:  # the engine stopped or failed: the stream ends
            return
        if events is None:  # fell behind the log's window: start over from a snapshot
            events, last_id = await loop.call(snapshot)
        elif events:
            last_id = events[-1].event_id
        if events:
            yield kv_event_batch_to_pb(events, name)
