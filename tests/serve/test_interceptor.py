"""The interceptor maps exceptions to statuses for every handler kind, over a real socket."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from tests.serve.conftest import Served
from tests.serve.fake_services import PROBE_SERVICE

EXPECTED = [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature: must be >= 0, got -1"),
    ("convert", grpc.StatusCode.INVALID_ARGUMENT, "finish_reason: unknown enum value 999"),
    ("notfound", grpc.StatusCode.NOT_FOUND, "request_id: no request 'r9'"),
    ("overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 waiting)"),
    ("unavailable", grpc.StatusCode.UNAVAILABLE, "engine is stopping"),
    ("value", grpc.StatusCode.INTERNAL, "internal error: ValueError: a bug, not a bad message"),
    ("runtime", grpc.StatusCode.INTERNAL, "internal error: RuntimeError: boom"),
]


def _new_request(request_id: str) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(new_request=engine_pb2.NewEngineRequest(request_id=request_id))


@pytest.mark.parametrize(("kind", "code", "message"), EXPECTED)
async def test_unary_unary(served: Served, kind: str, code: grpc.StatusCode, message: str) -> None:
    stub = engine_pb2_grpc.EngineStub(served.channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(engine_pb2.AbortRequest(request_id=kind))
    assert (info.value.code(), info.value.details()) == (code, message)


@pytest.mark.parametrize(("kind", "code", "message"), EXPECTED)
async def test_unary_stream_fails_after_first_message(
    served: Served, kind: str, code: grpc.StatusCode, message: str
) -> None:
    call = engine_pb2_grpc.EngineStub(served.channel).Generate(_new_request(kind))
    first = await call.read()
    assert list(first.token_ids) == [1]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert (info.value.code(), info.value.details()) == (code, message)


async def test_success_passes_through(served: Served) -> None:
    stub = engine_pb2_grpc.EngineStub(served.channel)
    assert (await stub.Abort(engine_pb2.AbortRequest(request_id="ok"))).found
    responses = [list(r.token_ids) async for r in stub.Generate(_new_request("ok"))]
    assert responses == [[1], [2]]


async def test_servicer_abort_keeps_its_own_status(served: Served) -> None:
    stub = engine_pb2_grpc.EngineStub(served.channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.MigrateOut(engine_pb2.MigrateOutRequest(request_id="r1"))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert info.value.details() == "request_id: r1 is live"


async def test_writer_style_stream_fails_after_first_message(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    call = engine_pb2_grpc.EngineStub(served.channel).WatchLoad(engine_pb2.WatchLoadRequest())
    assert (await call.read()).engine == "fake"
    with caplog.at_level(logging.ERROR, logger="dualpace.serve.interceptor"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error: RuntimeError: load sampler died"
    [record] = [r for r in caplog.records if r.name == "dualpace.serve.interceptor"]
    assert "/dualpace.v1.Engine/WatchLoad" in record.getMessage() and record.exc_info is not None


async def test_stream_stream(served: Served) -> None:
    call = engine_pb2_grpc.EngineStub(served.channel).ImportKv()
    await call.write(engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()))
    assert (await call.read()).prepared.total_bytes == 1
    await call.write(engine_pb2.ImportKvMessage(header=engine_pb2.ImportKvHeader(request_id="invalid")))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "sampling.temperature: must be >= 0, got -1"


async def test_stream_unary(served: Served) -> None:
    collect = served.channel.stream_unary(f"/{PROBE_SERVICE}/Collect")
    assert await collect(iter([b"a", b"b"])) == b"ab"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(iter([b"a", b"overloaded"]))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 waiting)")


async def test_client_cancel_closes_the_servicer_stream(served: Served) -> None:
    call = engine_pb2_grpc.EngineStub(served.channel).Generate(_new_request("hang"))
    await call.read()
    call.cancel()
    await asyncio.wait_for(served.engine.generate_closed.wait(), timeout=5)
