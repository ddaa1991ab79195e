"""The router's prefix index, kept from each engine's WatchKvEvents stream.

Every (re)subscription starts with the engine's snapshot (all_cleared, then what it caches
now), so a restarted router, or one whose stream broke, rebuilds the index from the
engines. An engine running with --prefix-caching off answers FAILED_PRECONDITION and is
not asked again.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from dualpace.kv.prefix_index import PrefixIndex

log = logging.getLogger(__name__)
RECONNECT_DELAY_S = 0.5


async def follow_kv_events(handle, index: PrefixIndex) -> None:
    """Apply `handle`'s engine's KV events to `index` until cancelled (reconnecting)."""
    while True:
        try:
            async for engine, events in handle.watch_kv_events():
                index.apply(engine, events)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.info("engine %s publishes no KV events (prefix caching off)", handle.name)
                return
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return  # an engine from before KV events
        except Exception:  # the index is an optimisation: never let it take the router down
            log.exception("engine %s: KV event stream failed", handle.name)
        index.forget(handle.name)  # stale until the next snapshot arrives
        await asyncio.sleep(RECONNECT_DELAY_S)
