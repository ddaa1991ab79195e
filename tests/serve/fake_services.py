"""A fake Engine servicer and a raw-bytes probe service whose handlers raise on request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from dualpace.errors import InvalidArgument, Overloaded, RequestNotFound, Unavailable
from dualpace.wire import common
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc

ENGINE_SERVICE = "dualpace.v1.Engine"
PROBE_SERVICE = "test.Probe"


def raise_for(kind: str) -> None:
    """Raises the exception named by `kind`; returns for anything else."""
    if kind == "invalid":
        raise InvalidArgument("sampling.temperature", "must be >= 0, got -1")
    if kind == "convert":
        common.finish_reason_from_pb(999)
    if kind == "value":
        raise ValueError("a bug, not a bad message")
    if kind == "runtime":
        raise RuntimeError("boom")
    if kind == "notfound":
        raise RequestNotFound("r9")
    if kind == "overloaded":
        raise Overloaded("queue full (64 waiting)")
    if kind == "unavailable":
        raise Unavailable("engine is stopping")


class FailingEngine(engine_pb2_grpc.EngineServicer):
    """Each rpc raises the error named by the request id (or message), after one reply when streaming."""

    def __init__(self) -> None:
        self.generate_closed = asyncio.Event()

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        request_id = request.new_request.request_id
        try:
            yield engine_pb2.EngineGenerateResponse(request_id=request_id, token_ids=[1])
            if request_id == "hang":
                await asyncio.Event().wait()
            raise_for(request_id)
            yield engine_pb2.EngineGenerateResponse(request_id=request_id, token_ids=[2])
        finally:
            self.generate_closed.set()

    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        raise_for(request.request_id)
        return engine_pb2.AbortResponse(found=True)

    async def MigrateOut(
        self, request: engine_pb2.MigrateOutRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.MigrateOutResponse:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request.request_id} is live")

    async def WatchLoad(self, request: engine_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext) -> None:
        await context.write(engine_pb2.LoadSnapshot(engine="fake"))
        raise RuntimeError("load sampler died")

    async def ImportKv(
        self, request_iterator: AsyncIterator[engine_pb2.ImportKvMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.ImportKvReply]:
        async for message in request_iterator:
            if message.WhichOneof("kind") == "header":
                raise_for(message.header.request_id)
            yield engine_pb2.ImportKvReply(prepared=engine_pb2.ImportKvPrepared(total_bytes=1))


async def _collect(request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    """Stream-unary probe: concatenates the requests; a request names an error to raise."""
    parts = []
    async for part in request_iterator:
        raise_for(part.decode())
        parts.append(part)
    return b"".join(parts)


def register_all(server: grpc.aio.Server, engine: FailingEngine) -> None:
    """Adds the fake Engine and the probe service to a server."""
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    probe = grpc.method_handlers_generic_handler(PROBE_SERVICE, {"Collect": grpc.stream_unary_rpc_method_handler(_collect)})
    server.add_generic_rpc_handlers((probe,))
