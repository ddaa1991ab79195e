"""The generated stubs work with the installed grpcio: a fake Engine on a real socket."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire import common
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc


class _EchoEngine(engine_pb2_grpc.EngineServicer):
    """Streams the prompt back one token per message; imports KV by counting the layers said written."""

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        new_request = request.new_request
        prompt_token_ids = list(new_request.prompt_token_ids)
        for index, token_id in enumerate(prompt_token_ids):
            is_last = index == len(prompt_token_ids) - 1
            yield engine_pb2.EngineGenerateResponse(
                request_id=new_request.request_id,
                token_ids=[token_id],
                first_token_index=index,
                finish_reason=common.finish_reason_to_pb(FinishReason.LENGTH if is_last else None),
                engine="echo",
            )

    async def ImportKv(
        self, request_iterator: AsyncIterator[engine_pb2.ImportKvMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.ImportKvReply]:
        total_bytes = 0
        request_id = ""
        async for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "header":
                request_id = message.header.request_id
                total_bytes = message.header.total_bytes
            elif kind == "tcp_written" and len(message.tcp_written.layer_crc32) != 2:
                total_bytes = 0  # the echo takes two layers
            elif kind == "prepare":
                yield engine_pb2.ImportKvReply(prepared=engine_pb2.ImportKvPrepared(total_bytes=total_bytes))
            elif kind == "commit":
                yield engine_pb2.ImportKvReply(committed=engine_pb2.ImportKvCommitted(request_id=request_id))


@pytest.fixture
async def engine_stub() -> AsyncIterator[engine_pb2_grpc.EngineStub]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(_EchoEngine(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield engine_pb2_grpc.EngineStub(channel)
    await server.stop(grace=None)


async def test_generate_streams_tokens(engine_stub: engine_pb2_grpc.EngineStub) -> None:
    request = engine_pb2.EngineGenerateRequest(
        new_request=engine_pb2.NewEngineRequest(
            request_id="r1",
            prompt_token_ids=[5, 6, 7],
            sampling=common.sampling_params_to_pb(SamplingParams(seed=1)),
        )
    )
    responses = [response async for response in engine_stub.Generate(request)]
    assert [list(response.token_ids) for response in responses] == [[5], [6], [7]]
    assert [common.finish_reason_from_pb(r.finish_reason) for r in responses] == [None, None, FinishReason.LENGTH]


async def test_import_kv_two_phase(engine_stub: engine_pb2_grpc.EngineStub) -> None:
    call = engine_stub.ImportKv()
    await call.write(engine_pb2.ImportKvMessage(header=engine_pb2.ImportKvHeader(request_id="r2", total_bytes=64)))
    await call.write(engine_pb2.ImportKvMessage(tcp_written=engine_pb2.KvTcpWritten(layer_crc32=[7, 9])))
    await call.write(engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()))
    prepared = await call.read()
    assert prepared.WhichOneof("kind") == "prepared" and prepared.prepared.total_bytes == 64
    await call.write(engine_pb2.ImportKvMessage(commit=engine_pb2.ImportKvCommit()))
    committed = await call.read()
    assert committed.committed.request_id == "r2"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
