"""The gRPC transport of a KV migration: stream a transfer to the target's ImportKv."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from dualpace.engine.kv_transfer import KvChunk, KvTransferHeader
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.serve.server import DEFAULT_MAX_MESSAGE_BYTES
from dualpace.wire.engine_messages import kv_chunk_to_pb, kv_header_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc

TRANSFER_TIMEOUT_S = 120.0


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
    ]


class GrpcKvSender:
    """send(header, chunks) for dualpace.engine.migration.migrate_out, over one ImportKv stream."""

    def __init__(self, target_address: str, faults: FaultConfig | None = None, timeout_s: float = TRANSFER_TIMEOUT_S):
        self.target_address = target_address
        self.faults = faults or FaultConfig()
        self.timeout_s = timeout_s

    async def __call__(self, header: KvTransferHeader, chunks: AsyncIterator[KvChunk]) -> str:
        async with grpc.aio.insecure_channel(self.target_address, options=channel_options()) as channel:
            call = engine_pb2_grpc.EngineStub(channel).ImportKv(timeout=self.timeout_s)
            try:
                await call.write(kv_header_to_pb(header))
                async for chunk in chunks:
                    outgoing = self.faults.outgoing_chunk(chunk)
                    if outgoing is not None:
                        await call.write(kv_chunk_to_pb(outgoing))
                await call.write(engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()))
                await self._expect(call, "prepared")
                await call.write(engine_pb2.ImportKvMessage(commit=engine_pb2.ImportKvCommit()))
                committed = await self._expect(call, "committed")
                await call.done_writing()
                return committed.engine
            except BaseException:
                call.cancel()  # the target drops the partial import
                raise

    @staticmethod
    async def _expect(call, kind: str):
        reply = await call.read()
        if reply is grpc.aio.EOF:
            # The target ended the stream: its status says why (e.g. a corrupt chunk).
            await call.wait_for_connection()
            code = await call.code()
            details = await call.details()
            raise Unavailable(f"KV import ended before '{kind}': {code.name if code else 'unknown'}: {details}")
        if reply.WhichOneof("kind") != kind:
            raise Unavailable(f"KV import replied {reply.WhichOneof('kind')!r}, expected {kind!r}")
        return getattr(reply, kind)
