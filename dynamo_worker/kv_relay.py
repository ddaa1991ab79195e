"""Follow each engine's WatchKvEvents and hand the node's events (kv_events.NodeKvView) to
Dynamo's KvEventPublisher (its publish_batch, passed in: this module does not import Dynamo).

Every subscription starts with the engine's snapshot (all_cleared, then what it caches), so a
reconnect after a restart resynchronises. When a stream ends or fails, the engine's blocks are
removed at once (a restarted engine's cache is empty) and the relay reconnects after
RECONNECT_DELAY_S. An engine with prefix caching off (FAILED_PRECONDITION) or from before KV
events (UNIMPLEMENTED) is not asked again. `close` stops the streams; nothing is published after."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from dynamo_worker.engine_client import EngineKvClient, EngineStreamError
from dynamo_worker.kv_events import NodeKvView

log = logging.getLogger("dualpace.dynamo")

RECONNECT_DELAY_S = 0.5
NOT_PUBLISHING = {"FAILED_PRECONDITION": "prefix caching is off", "UNIMPLEMENTED": "it has no KV events"}


class KvRelay:
    def __init__(self, view: NodeKvView, publish_batch: Callable[[list[dict]], None],
                 clients: list[EngineKvClient]):
        self.view = view
        self.publish_batch = publish_batch
        self.clients = clients
        self.num_published_events = 0
        self.num_resyncs = 0  # streams that ended or failed (each one a clear of that engine)
        self._closing = False
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(client)) for client in self.clients]

    @property
    def num_following(self) -> int:
        """Engines whose KV events the relay follows or will reconnect to (not those that publish none)."""
        return sum(not task.done() for task in self._tasks)

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        for client in self.clients:
            await client.close()
        log.info("dualpace-dynamo: KV relay stopped (%d events published, %d streams resynchronised)",
                 self.num_published_events, self.num_resyncs)

    def _publish(self, events: list[dict]) -> None:
        if not events or self._closing:
            return
        try:
            self.publish_batch(events)
            self.num_published_events += len(events)
        except Exception:  # a dropped batch costs cache hits, never the worker
            log.exception("dualpace-dynamo: KvEventPublisher refused %d events", len(events))

    async def _follow(self, client: EngineKvClient) -> None:
        reported = None  # the last problem logged, so that a down engine is not logged every 0.5 s
        while not self._closing:
            try:
                async for events in client.watch_kv_events():
                    if reported is not None:
                        log.info("dualpace-dynamo: KV events of engine %s flowing again", client.address)
                        reported = None
                    self._publish(self.view.apply(client.address, events))
                problem = "the stream ended"
            except EngineStreamError as exc:
                if exc.code_name in NOT_PUBLISHING:
                    log.info("dualpace-dynamo: engine %s publishes no KV events (%s)", client.address,
                             NOT_PUBLISHING[exc.code_name])
                    self._publish(self.view.clear(client.address))
                    return
                problem = exc.code_name
            except Exception:  # a malformed event must not end the relay
                log.exception("dualpace-dynamo: KV events of engine %s failed", client.address)
                problem = "an error"
            self.num_resyncs += 1
            self._publish(self.view.clear(client.address))
            if problem != reported:
                log.info("dualpace-dynamo: KV events of engine %s: %s; its blocks are withdrawn, "
                         "reconnecting", client.address, problem)
                reported = problem
            await asyncio.sleep(RECONNECT_DELAY_S)
