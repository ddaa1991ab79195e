"""WatchKvEvents for the Engine servicer: a snapshot, then the prefix cache's events as they come,
each batch as core KvEvents (the servicer converts them: dualpace.wire.kv_events).

The event log lives in the scheduler, which the step thread mutates, so it is read only
through EngineLoop.call (between steps), every `poll_s`. A stopping engine runs no more
commands, so each read also ends when the loop stops: the stream never holds up shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from dualpace.engine.loop import EngineLoop
from dualpace.errors import FailedPrecondition, Unavailable
from dualpace.kv.events import KvEvent

DEFAULT_POLL_S = 0.05
T = TypeVar("T")


async def between_steps(loop: EngineLoop, read: Callable[[], T]) -> T:
    """`read()` run between steps; Unavailable when the loop stops first."""
    call = asyncio.ensure_future(loop.call(read))
    stopped = asyncio.ensure_future(loop.stopped.wait())
    try:
        await asyncio.wait({call, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not call.done():
        call.cancel()  # a cancelled command is skipped, never run
        raise Unavailable(f"engine {loop.core.config.name} stopped")
    return call.result()


async def watch_kv_events(loop: EngineLoop, poll_s: float = DEFAULT_POLL_S) -> AsyncIterator[list[KvEvent]]:
    """The engine's event batches: first a snapshot (never empty: it starts with an all-cleared
    event), then every non-empty batch of new events; FailedPrecondition without a prefix cache."""
    log = loop.core.scheduler.prefix_cache.events if loop.core.scheduler.prefix_cache is not None else None
    if log is None:
        raise FailedPrecondition(f"engine {loop.core.config.name} runs with --prefix-caching off: no KV events")

    def snapshot() -> tuple[list[KvEvent], int]:
        return log.snapshot(), log.last_event_id

    events, last_id = await between_steps(loop, snapshot)
    yield events
    while not loop.stopped.is_set():
        await asyncio.sleep(poll_s)
        try:
            events = await between_steps(loop, lambda: log.since(last_id))
            if events is None:  # fell behind the log's window: start over from a snapshot
                events, last_id = await between_steps(loop, snapshot)
            elif events:
                last_id = events[-1].event_id
        except Unavailable:  # the engine stopped or failed: the stream ends
            return
        if events:
            yield events
