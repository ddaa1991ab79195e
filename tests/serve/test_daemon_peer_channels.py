"""An engine daemon's KV senders share its PeerChannels: one connection per peer across transfers.

Wired as dualpace.serve.engine_daemon wires it (one PeerChannels given to SameHostKv and to the
EngineServicer, for both KV transports), between in-process servers on loopback: the target records
the peer address of each ImportKv call, and a new client port is a new connection. Migrations and
a prefix copy to one target share one connection; a target that went away fails the transfer, its
channel is dropped, and once it is back the next transfer connects afresh; closing the channels
(the daemon does at shutdown) shuts every kept channel down.
"""

from __future__ import annotations

import grpc
import pytest

from dualpace.engine.transfer.kv_shm_import import SharedKvPool
from dualpace.engine.transfer.kv_tcp_import import TcpDataServer
from dualpace.sampling import SamplingParams
from dualpace.serve.engine_servicer import EngineServicer
from dualpace.serve.kv_shm_transport import SameHostKv
from dualpace.serve.peer_channels import PeerChannels
from dualpace.serve.peers import PeerList
from dualpace.serve.server import start_server
from dualpace.wire.engine_messages import copy_prefix_request_to_pb, migrate_out_request_to_pb
from dualpace.wire.v1 import engine_pb2_grpc
from tests.engine.test_migration import started, stop, wait_tokens

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
ENGINE = ["dualpace.v1.Engine"]


class RecordingTarget(EngineServicer):
    """An ImportKv target that notes the client address (ip:port) of every import stream."""

    def __init__(self, loop, same_host: SameHostKv):
        super().__init__(loop, same_host=same_host)
        self.peers: list[str] = []

    async def ImportKv(self, request_iterator, context):
        self.peers.append(context.peer())
        async for reply in super().ImportKv(request_iterator, context):
            yield reply


class Pair:
    """A source engine served as a daemon serves it, and a recording target."""

    async def start(self, tiny, transport: str) -> Pair:
        self.source, self.target = await started(tiny, "src"), await started(tiny, "dst")
        self.data = await TcpDataServer.start("127.0.0.1")  # the target's KV data socket
        self.recording = RecordingTarget(self.target[0], SameHostKv("tcp", SharedKvPool(None), tcp=self.data))
        self.target_server = await self.serve_target("127.0.0.1:0")
        self.target_address = self.target_server.address
        self.channels = PeerChannels()
        same_host = SameHostKv(transport, SharedKvPool(None), channels=self.channels)
        source = EngineServicer(self.source[0], same_host=same_host, peers=PeerList([self.target_address]),
                                channels=self.channels)
        self.source_server = await start_server(
            "127.0.0.1:0", lambda server: engine_pb2_grpc.add_EngineServicer_to_server(source, server), ENGINE)
        self.client = grpc.aio.insecure_channel(self.source_server.address)
        self.stub = engine_pb2_grpc.EngineStub(self.client)
        return self

    async def serve_target(self, address: str):
        return await start_server(
            address, lambda server: engine_pb2_grpc.add_EngineServicer_to_server(self.recording, server), ENGINE)

    async def migrate(self, request_id: str):
        channel = await self.source[0].add_request(request_id, PROMPT, PARAMS)
        await wait_tokens(channel, 2)
        reply = await self.stub.MigrateOut(migrate_out_request_to_pb(request_id, self.target_address), timeout=60)
        await self.target[0].abort(request_id)  # nobody resumes it: its blocks go back at once
        return reply

    async def close(self) -> None:
        await self.client.close()
        await self.source_server.stop(0)
        await self.target_server.stop(0)
        await self.channels.close()
        await self.data.close()
        await stop(self.source, self.target)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
async def test_migrations_and_a_prefix_copy_share_one_connection(tiny, transport):
    pair = await Pair().start(tiny, transport)
    for request_id in ("a", "b", "c"):
        assert (await pair.migrate(request_id)).target_engine == "dst"
    finished = await pair.source[0].add_request("p", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    async for _ in finished.follow():
        pass  # finished: its full blocks stay cached on the source
    copied = await pair.stub.CopyPrefix(copy_prefix_request_to_pb(PROMPT, pair.target_address), timeout=60)
    assert copied.num_tokens > 0
    assert len(pair.recording.peers) == 4 and len(set(pair.recording.peers)) == 1  # one connection
    kept = pair.channels.kept(pair.target_address, None)
    await pair.close()
    assert kept.get_state() == grpc.ChannelConnectivity.SHUTDOWN  # closed with the channels, as at shutdown


async def test_a_target_that_went_away_is_reconnected_after_its_channel_is_dropped(tiny):
    pair = await Pair().start(tiny, "auto")
    await pair.migrate("before")
    kept = pair.channels.kept(pair.target_address, None)
    await pair.target_server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await pair.migrate("while-gone")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert pair.channels.kept(pair.target_address, None) is None  # dropped: the next transfer connects afresh
    await pair.source[0].abort("while-gone")  # it stayed on the source
    pair.target_server = await pair.serve_target(pair.target_address)  # the target is back on its port
    assert (await pair.migrate("after")).target_engine == "dst"
    assert len(set(pair.recording.peers)) == 2  # a second connection, to the target that came back
    assert pair.channels.kept(pair.target_address, None) not in (None, kept)
    await pair.close()
    assert kept.get_state() == grpc.ChannelConnectivity.SHUTDOWN  # the dropped one was closed too
