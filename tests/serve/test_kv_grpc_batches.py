"""KV over gRPC with several chunks per message (KvChunkBatch) and reads ahead of the writes.

A real ImportKv target (an in-process EngineServicer on loopback, no shared memory): a batch is
imported as its chunks one by one would be (the request continues exactly); a fault inside a batch
fails the transfer with the two-phase rules intact (the request runs on the source, no block held
on the target); and a target that does not know batches gets single chunks after its refusal.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dualpace.engine.transfer.migration import migrate_out
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.serve.engine_servicer import EngineServicer
from dualpace.serve.kv_transport import GrpcKvSender
from dualpace.serve.server import channel_options, start_server
from dualpace.wire.engine_messages import kv_header_to_pb
from dualpace.wire.kv_chunk_wire import IMPORT_KV_METHOD, encode_chunk_batch, serialize_import_message
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from tests.engine.test_migration import started, stop, wait_tokens

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
CHUNK_BYTES = 700  # many small chunks, as a short context's per-layer chunks are


class Served:
    async def start(self, tiny) -> Served:
        self.source, self.target = await started(tiny, "src"), await started(tiny, "dst")
        servicer = EngineServicer(self.target[0])
        self.server = await start_server(
            "127.0.0.1:0", lambda server: engine_pb2_grpc.add_EngineServicer_to_server(servicer, server),
            ["dualpace.v1.Engine"])
        return self

    async def close(self) -> None:
        await self.server.stop(0)
        await stop(self.source, self.target)


def expected(tiny) -> list[int]:
    return OfflineGenerator(tiny).generate([PROMPT], [PARAMS])[0].output_token_ids


async def one_batch_send(address: str, header, chunks) -> str:
    """Every chunk in one KvChunkBatch message, then prepare and commit (the batch path, deterministic)."""
    batch = [chunk async for chunk in chunks]
    assert len(batch) > 3
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        call = channel.stream_stream(IMPORT_KV_METHOD, request_serializer=serialize_import_message,
                                     response_deserializer=engine_pb2.ImportKvReply.FromString)()
        await call.write(kv_header_to_pb(header))
        await call.write(encode_chunk_batch(batch))
        await call.write(engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()))
        assert (await call.read()).WhichOneof("kind") == "prepared"
        await call.write(engine_pb2.ImportKvMessage(commit=engine_pb2.ImportKvCommit()))
        committed = await call.read()
        await call.done_writing()
        return committed.committed.engine


async def test_a_batch_is_imported_as_its_chunks_and_the_request_continues_exactly(tiny):
    served = await Served().start(tiny)
    channel = await served.source[0].add_request("b", PROMPT, PARAMS)
    await wait_tokens(channel, 3)
    address = served.server.address
    stats = await migrate_out(served.source[0], "b", lambda header, chunks: one_batch_send(address, header, chunks),
                              chunk_bytes=CHUNK_BYTES)
    assert stats.num_chunks > 3 and stats.target_engine == "dst"
    await assert_continues_on_target(served, channel, "b", expected(tiny))
    await served.close()


async def assert_continues_on_target(served, channel, request_id: str, tokens: list[int]) -> None:
    emitted = len(channel.output_token_ids)
    rest = [t async for update in served.target[0].channel(request_id).follow(emitted) for t in update.new_token_ids]
    assert channel.output_token_ids + rest == tokens
    assert served.source[0].load().kv_blocks_used == 0


async def test_grpc_sender_continues_exactly_with_fewer_messages_than_chunks(tiny):
    served = await Served().start(tiny)
    channel = await served.source[0].add_request("g", PROMPT, PARAMS)
    await wait_tokens(channel, 3)
    sender = GrpcKvSender(served.server.address)
    stats = await migrate_out(served.source[0], "g", sender, chunk_bytes=CHUNK_BYTES)
    assert 1 <= sender.num_messages <= stats.num_chunks
    await assert_continues_on_target(served, channel, "g", expected(tiny))
    await served.close()


@pytest.mark.parametrize("faults", [FaultConfig(kv_corrupt_chunk=5), FaultConfig(kv_drop_chunk=4),
                                    FaultConfig(kv_cut_after=6)])
async def test_a_fault_among_batched_chunks_leaves_the_request_on_the_source(tiny, faults):
    served = await Served().start(tiny)
    channel = await served.source[0].add_request("f", PROMPT, PARAMS)
    await wait_tokens(channel, 3)
    with pytest.raises(Unavailable):
        await migrate_out(served.source[0], "f", GrpcKvSender(served.server.address, faults),
                          chunk_bytes=CHUNK_BYTES)
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]
    assert tokens == expected(tiny)
    assert channel.finish_reason == FinishReason.LENGTH and channel.migrated_to is None
    for _ in range(200):  # the target drops the import when it sees the stream cancelled (its cleanup)
        if served.target[0].load().kv_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert served.target[0].load().kv_blocks_used == 0 and not served.target[0].core.scheduler.requests
    await served.close()


async def test_kept_channels_are_reused_and_a_failed_transfer_drops_its_own(tiny):
    from dualpace.serve.peer_channels import PeerChannels

    served = await Served().start(tiny)
    channels = PeerChannels()
    try:
        address = served.server.address
        first = await served.source[0].add_request("k1", PROMPT, PARAMS)
        await wait_tokens(first, 2)
        await migrate_out(served.source[0], "k1", GrpcKvSender(address, channels=channels), chunk_bytes=CHUNK_BYTES)
        kept = channels.get(address, None)
        second = await served.source[0].add_request("k2", PROMPT, PARAMS)
        await wait_tokens(second, 2)
        with pytest.raises(Unavailable):
            await migrate_out(served.source[0], "k2", GrpcKvSender(address, FaultConfig(kv_corrupt_chunk=1),
                                                                   channels=channels), chunk_bytes=CHUNK_BYTES)
        assert channels.get(address, None) is not kept  # dropped after the failure: the next one connects afresh
        # the failed move resumed k2 on the source: it finishes there before k3's blocks are counted
        async for _ in second.follow(len(second.output_token_ids)):
            pass
        third = await served.source[0].add_request("k3", PROMPT, PARAMS)
        await wait_tokens(third, 2)
        await migrate_out(served.source[0], "k3", GrpcKvSender(address, channels=channels), chunk_bytes=CHUNK_BYTES)
        await assert_continues_on_target(served, third, "k3", expected(tiny))
    finally:  # also after a failure: an open server or channel would hang the loop's close
        await channels.close()
        await served.close()
