"""The router's handles on the engines: a channel, the engine's identity, and its
latest load view, kept fresh by a WatchLoad subscription (not a poll per request)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from dualpace.engine.channel import ChannelUpdate
from dualpace.engine.load import RequestSummary
from dualpace.kv.events import KvEvent
from dualpace.kv.prefix_index import PrefixIndex
from dualpace.policy.views import EngineView
from dualpace.sampling_params import SamplingParams
from dualpace.serve.auth import aio_token_interceptors
from dualpace.serve.logging_setup import request_metadata
from dualpace.serve.security import TlsConfig, peer_channel
from dualpace.serve.server import channel_options
from dualpace.wire.engine_messages import (
    abort_request_to_pb,
    copy_prefix_request_to_pb,
    engine_view_from_pb,
    generate_update_from_pb,
    info_request_to_pb,
    list_requests_to_pb,
    migrate_out_request_to_pb,
    new_request_to_pb,
    request_summary_from_pb,
    resume_request_to_pb,
    watch_load_request_to_pb,
)
from dualpace.wire.kv_events import kv_event_batch_from_pb, watch_kv_events_request_to_pb
from dualpace.wire.v1 import engine_pb2_grpc
from router.kv_index_watch import follow_kv_events

log = logging.getLogger(__name__)

WATCH_INTERVAL_MS = 100
RECONNECT_DELAY_S = 0.5


class EngineStream:
    """An engine's Generate stream as core updates. The call starts when the stream is made;
    errors are grpc.aio.AioRpcError, as from the call itself."""

    def __init__(self, call):
        self._call = call

    async def __aiter__(self) -> AsyncIterator[ChannelUpdate]:
        async for response in self._call:
            yield generate_update_from_pb(response)


class EngineHandle:
    """One engine as the router sees it: its latest load view (watched) and typed calls."""

    def __init__(self, address: str, expected_kind: str, auth_token: str | None = None,
                 tls: TlsConfig | None = None):
        self.address = address
        self.expected_kind = expected_kind
        self.name = expected_kind  # replaced by the engine's own name once Info answers
        # With a shared token (--auth-token-file) every call on this channel carries it; with
        # `tls` (--engine-tls on) a TCP engine is reached over TLS, as the engines reach each other.
        self.channel = peer_channel(address, tls, [*channel_options(), ("grpc.max_reconnect_backoff_ms", 1000)],
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

    # -- calls (the router's only way to talk to an engine) ---------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 num_prior_output_tokens: int = 0, hold_after_first_token: bool = False) -> EngineStream:
        """A new request that keeps running when the router's stream drops (the router resumes it);
        num_prior_output_tokens: the prompt's last tokens that it output before (a re-submission);
        hold_after_first_token: the router hands it to another engine after its first token."""
        return EngineStream(self.stub.Generate(
            new_request_to_pb(request_id, prompt_token_ids, params, keep_running_on_disconnect=True,
                              num_prior_output_tokens=num_prior_output_tokens,
                              hold_after_first_token=hold_after_first_token),
            metadata=request_metadata(request_id)))

    def resume(self, request_id: str, from_token_index: int) -> EngineStream:
        """Follow a request the engine holds, from its output token `from_token_index` on."""
        return EngineStream(self.stub.Generate(resume_request_to_pb(request_id, from_token_index),
                                               metadata=request_metadata(request_id)))

    async def abort(self, request_id: str, timeout_s: float) -> None:
        await self.stub.Abort(abort_request_to_pb(request_id), timeout=timeout_s,
                              metadata=request_metadata(request_id))

    async def list_requests(self, timeout_s: float = 5) -> list[RequestSummary]:
        listing = await self.stub.ListRequests(list_requests_to_pb(), timeout=timeout_s)
        return [request_summary_from_pb(info) for info in listing.requests]

    async def migrate_out(self, request_id: str, target_address: str, timeout_s: float = 60) -> None:
        """Move the request to the engine at `target_address` (two-phase; returns once committed)."""
        await self.stub.MigrateOut(migrate_out_request_to_pb(request_id, target_address), timeout=timeout_s,
                                   metadata=request_metadata(request_id))

    async def copy_prefix(self, token_ids: list[int], target_address: str,
                          timeout_s: float = 60) -> tuple[int, int, float]:
        """Copy this engine's cached prefix of token_ids to the engine at `target_address`:
        (tokens the target caches from it, of those the tokens sent, milliseconds to its commit)."""
        reply = await self.stub.CopyPrefix(copy_prefix_request_to_pb(token_ids, target_address), timeout=timeout_s)
        return reply.num_tokens, reply.num_sent_tokens, reply.duration_ms

    async def watch_kv_events(self) -> AsyncIterator[tuple[str, list[KvEvent]]]:
        """The engine's KV events, batch by batch: (engine name, events); starts with its snapshot."""
        async for batch in self.stub.WatchKvEvents(watch_kv_events_request_to_pb()):
            yield kv_event_batch_from_pb(batch, self.name)

    async def mark_unhealthy(self) -> None:
        """A call to the engine failed: stop placing work there until its load stream is back."""
        if self.view is not None:
            await self._publish(EngineView(**{**self.view.__dict__, "healthy": False}))

    async def _watch(self) -> None:
        while True:
            try:
                info = await self.stub.Info(info_request_to_pb(), timeout=5)
                self.name = info.engine
                async for snapshot in self.stub.WatchLoad(watch_load_request_to_pb(WATCH_INTERVAL_MS)):
                    await self._publish(engine_view_from_pb(snapshot, self.expected_kind))
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
