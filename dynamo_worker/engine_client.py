"""The worker's typed async client of one engine of its node: its WatchKvEvents stream only.

Protobuf stays here and in dualpace.wire; the worker sees dualpace.kv.events.KvEvent and
EngineStreamError (the gRPC status code's name and details)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from dualpace.kv.events import KvEvent
from dualpace.serve.auth import aio_token_interceptors
from dualpace.serve.server import channel_options
from dualpace.wire.kv_events import kv_event_batch_from_pb, watch_kv_events_request_to_pb
from dualpace.wire.v1 import engine_pb2_grpc


class EngineStreamError(Exception):
    def __init__(self, code_name: str, details: str):
        super().__init__(f"{code_name}: {details}")
        self.code_name = code_name
        self.details = details


class EngineKvClient:
    def __init__(self, address: str, auth_token: str | None = None):
        self.address = address
        self.channel = grpc.aio.insecure_channel(
            address, options=[*channel_options(), ("grpc.max_reconnect_backoff_ms", 1000)],
            interceptors=aio_token_interceptors(auth_token))
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    async def watch_kv_events(self) -> AsyncIterator[list[KvEvent]]:
        """The engine's KV events, batch by batch, starting with its snapshot (all_cleared, then
        every cached block). Ends when the engine ends the stream; EngineStreamError on failure."""
        try:
            async for batch in self.stub.WatchKvEvents(watch_kv_events_request_to_pb()):
                yield kv_event_batch_from_pb(batch, self.address)[1]
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            raise EngineStreamError(code.name if code is not None else "UNKNOWN", exc.details() or "") from None

    async def close(self) -> None:
        await self.channel.close()
