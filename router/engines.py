"""The router's handles on the engines: a channel, the engine's identity, and its
latest load view, kept fresh by a WatchLoad subscription (not a poll per request)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from dualpace.kv.prefix_index import PrefixIndex
from dualpace.serve.auth import aio_token_interceptors
from dualpace.serve.kv_transport import channel_options
from dualpace.wire.engine_messages import ENGINE_KIND_FROM_PB
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from router.kv_index_watch import follow_kv_events
from router.views import EngineView

log = logging.getLogger(__name__)

WATCH_INTERVAL_MS = 100
RECONNECT_DELAY_S = 0.5


class EngineHandle:
    def __init__(self, address: str, expected_kind: str, auth_token: str | None = None):
        self.address = address
        self.expected_kind = expected_kind
        self.name = expected_kind  # replaced by the engine's own name once Info answers
        # With a shared token (--auth-token-file) every call on this channel carries it.
        self.channel = grpc.aio.insecure_channel(address, options=[
            *channel_options(), ("grpc.max_reconnect_backoff_ms", 1000)],
            interceptors=aio_token_interceptors(auth_token))
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self.view: EngineView | None = None
        self.changed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self.view is not None and self.view.healthy

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.channel.close()

    async def mark_unhealthy(self) -> None:
        """A call to the engine failed: stop placing work there until its load stream is back."""
        if self.view is not None:
            await self._publish(EngineView(**{**self.view.__dict__, "healthy": False}))

    async def _watch(self) -> None:
        while True:
            try:
                info = await self.stub.Info(engine_pb2.InfoRequest(), timeout=5)
                self.name = info.engine
                async for snapshot in self.stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=WATCH_INTERVAL_MS)):
                    await self._publish(EngineView(
                        name=snapshot.engine,
                        kind=ENGINE_KIND_FROM_PB.get(snapshot.kind, self.expected_kind),
                        healthy=snapshot.serving,
                        kv_blocks_total=snapshot.kv_blocks_total,
                        kv_blocks_used=snapshot.kv_blocks_used,
                        block_size=snapshot.block_size,
                        num_running=snapshot.num_running,
                        num_waiting=snapshot.num_waiting,
                        itl_p50_ms=snapshot.itl_p50_ms,
                        itl_p99_ms=snapshot.itl_p99_ms,
                        kv_blocks_cached=snapshot.kv_blocks_cached,
                    ))
            except grpc.aio.AioRpcError as exc:
                log.info("engine %s at %s unreachable: %s", self.name, self.address, exc.code().name)
            except Exception:  # anything else must not end the watch: the engine would never come back
                log.exception("engine %s at %s: load stream failed", self.name, self.address)
            # An engine restarted on the same address (SIGKILL + start, systemd Restart=) is found
            # again by the next Info call: the channel reconnects (backoff at most 1 s).
            await self.mark_unhealthy()
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _publish(self, view: EngineView) -> None:
        async with self.changed:
            self.view = view
            self.changed.notify_all()


class EnginePool:
    """The engines the router knows, by name and by address."""

    def __init__(self, handles: list[EngineHandle]):
        self.handles = handles
        self.changed = asyncio.Event()  # set on any load update, for requests waiting for room
        self._forwarders: list[asyncio.Task] = []
        self.prefix_index = PrefixIndex()  # which engine caches which prefix (router.kv_index_watch)

    def start(self) -> None:
        for handle in self.handles:
            handle.start()
            self._forwarders.append(asyncio.create_task(self._forward_changes(handle)))
            self._forwarders.append(asyncio.create_task(follow_kv_events(handle, self.prefix_index)))

    async def _forward_changes(self, handle: EngineHandle) -> None:
        while True:
            async with handle.changed:
                await handle.changed.wait()
            self.changed.set()

    async def close(self) -> None:
        for task in self._forwarders:
            task.cancel()
        for handle in self.handles:
            await handle.close()

    def views(self) -> dict[str, EngineView]:
        return {h.name: h.view for h in self.handles if h.view is not None}

    def by_name(self, name: str) -> EngineHandle | None:
        return next((h for h in self.handles if h.name == name), None)

    def by_address(self, address: str) -> EngineHandle | None:
        return next((h for h in self.handles if h.address == address), None)

    def of_kind(self, kind: str) -> list[EngineHandle]:
        return [h for h in self.handles if h.expected_kind == kind]

    async def wait_ready(self, timeout_s: float) -> bool:
        """Until every engine has reported a load view (bounded)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not all(h.view is not None for h in self.handles):
                    self.changed.clear()
                    await self.changed.wait()
            return True
        except TimeoutError:
            return False
