"""Orphan leases: an engine request that runs for a reader who went away does not run forever.

The router starts engine requests with `keep_running_on_disconnect`, so that a request survives
the router's restart and a new stream can re-attach to it (a Generate resume). If nobody comes
back, the request would decode to max_tokens holding KV blocks with nobody reading. So each
request that runs with no stream following it holds a lease of `--orphan-timeout-s`: a stream
that attaches within it (a resume) keeps the request; otherwise the lease expires, the request
is aborted (its blocks return to the pool), logged, and counted in
`dualpace_orphaned_requests_total`.

A request has no reader when its last keep-running stream ends without the request having
finished or moved, and right after a KV import commits (the router resumes it on this engine
next). The lease clock is an asyncio timer in the daemon's event loop; the engine loop and the
scheduler know nothing of it.
"""

from __future__ import annotations

import asyncio

from dualpace.engine.loop import EngineLoop
from dualpace.errors import RequestNotFound, Unavailable
from dualpace.serve.logging_setup import get_logger

DEFAULT_ORPHAN_TIMEOUT_S = 30.0

log = get_logger(__name__)


class OrphanLeases:
    def __init__(self, loop: EngineLoop, timeout_s: float = DEFAULT_ORPHAN_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"orphan timeout must be > 0, got {timeout_s}")
        self.loop = loop
        self.timeout_s = timeout_s
        self._num_readers: dict[str, int] = {}
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self.num_orphaned = 0

    @property
    def leased_ids(self) -> list[str]:
        """Requests running with no reader now, their lease ticking."""
        return list(self._leases)

    def attach(self, request_id: str) -> None:
        """A stream follows the request from now on: no lease while it does."""
        self._num_readers[request_id] = self._num_readers.get(request_id, 0) + 1
        self._cancel(request_id)

    def detach(self, request_id: str, left_running: bool) -> None:
        """A stream stopped following the request; `left_running`: it ended before the request
        finished or moved, and the request was not aborted with it (keep_running_on_disconnect)."""
        remaining = self._num_readers.get(request_id, 1) - 1
        if remaining > 0:
            self._num_readers[request_id] = remaining
            return
        self._num_readers.pop(request_id, None)
        if left_running:
            self.start(request_id)

    def start(self, request_id: str) -> None:
        """The request runs unread from now (its stream left, or it just arrived by import)."""
        if self._num_readers.get(request_id):
            return
        self._cancel(request_id)
        self._leases[request_id] = asyncio.get_running_loop().call_later(
            self.timeout_s, lambda: asyncio.ensure_future(self._expire(request_id)))

    def _cancel(self, request_id: str) -> None:
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.cancel()

    async def _expire(self, request_id: str) -> None:
        self._leases.pop(request_id, None)
        if self._num_readers.get(request_id) or request_id not in self.loop.channels:
            return  # re-attached meanwhile, or finished, moved or aborted already
        try:
            await self.loop.abort(request_id)
        except (RequestNotFound, Unavailable):
            return  # gone meanwhile, or the engine is stopping (its drain ends the request)
        self.num_orphaned += 1
        self.loop.metrics.request_orphaned()
        log.warning("orphaned request aborted: no stream re-attached within the lease", request_id=request_id,
                    orphan_timeout_s=self.timeout_s)

    def close(self) -> None:
        for request_id in list(self._leases):
            self._cancel(request_id)
