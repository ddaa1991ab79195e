"""Requests held after their first token for a hand-off, taken by their move without a step boundary.

The router marks a request it will hand to the CPU engine right after its GPU prefill
(`hold_after_first_token`); the scheduler pauses it in the apply of the step that samples that token
(Scheduler.apply, `RequestEvent.held`). The engine loop registers each such request here at the step
boundary that follows, before the token is published (so the router, which starts the move when it
sees the token, always finds it), with the KV slots of its tokens. `migrate_out` then takes the request
with `take` at once, even while the engine's next step (often a long prefill) is in flight: no step
reads or writes a paused request, and the slots were read at a boundary.

A hold that no move takes within `timeout_s` (the router went away, or its MigrateOut failed before
reaching this engine) is released at the next boundary (Scheduler.release_hold) and the request
decodes here: holding never loses a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from dualpace.engine.request import EngineRequest, RequestEvent, RequestState
from dualpace.errors import Unavailable

log = logging.getLogger(__name__)

DEFAULT_HOLD_TIMEOUT_S = 5.0  # the router's MigrateOut comes within milliseconds; this covers a stalled router


class HandoffHolds:
    def __init__(self, core, call: Callable[[Callable[[], Any]], Awaitable[Any]],
                 timeout_s: float = DEFAULT_HOLD_TIMEOUT_S):
        """core: the engine's EngineCore (its scheduler and KV slots); call: EngineLoop.call (runs a
        command at a step boundary)."""
        self._core = core
        self._call = call
        self.timeout_s = timeout_s
        self._held: dict[str, tuple[EngineRequest, list[int]]] = {}
        self._releases: set[asyncio.Task] = set()
        self.num_taken = 0
        self.num_released = 0

    def register(self, events: list[RequestEvent]) -> None:
        """At the step boundary after the step that made `events` (event-loop thread, no step in flight)."""
        for event in events:
            if not event.held:
                continue
            request = self._core.scheduler.get(event.request_id)
            slot_ids = self._core.kv_slot_ids(event.request_id, request.num_computed_tokens) \
                if self._core.moves_kv else []  # else it moves without KV (EngineCore.moves_kv)
            self._held[event.request_id] = (request, slot_ids)
            asyncio.get_running_loop().call_later(self.timeout_s, self._expire, event.request_id)

    def take(self, request_id: str) -> tuple[EngineRequest, list[int]] | None:
        """The held request and its KV slots, now, for its move; None when it is not held here (then the
        move pauses it at a step boundary as usual). Safe while a step runs: that step does not hold it."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        request, slot_ids = held
        if request.state != RequestState.PAUSED or not request.hold_after_first_token:
            return None  # aborted meanwhile (the usual pause then says so)
        request.hold_after_first_token = False  # taken: Scheduler.release_hold leaves it alone
        self.num_taken += 1
        return request, slot_ids

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def _expire(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is None:
            return  # taken by its move
        task = asyncio.ensure_future(self._release(request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, request_id: str) -> None:
        try:
            released = await self._call(lambda: self._core.scheduler.release_hold(request_id))
        except Unavailable:
            return  # the engine stopped: nothing to run it on
        if released:
            self.num_released += 1
            log.warning("request %s was held %.1f s for a hand-off that did not come; it decodes here",
                        request_id, self.timeout_s)
