"""KV migration over the target's TCP data socket (gRPC as the control plane only).

A real ImportKv target (an in-process EngineServicer on loopback with a TcpDataServer on
127.0.0.1, no shared memory) and a real source engine: the KV lands in the target's reserved
blocks, straight or through its staging buffer, and the request continues token-identical there;
a wrong or replayed ticket is refused; a corrupt layer, a connection cut part-way, a cancel
mid-stream and a data socket that cannot be reached leave the request running on the source and
no block held on either side.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import shutil
import socket
import ssl
import threading

import grpc
import pytest

from dualpace.engine.transfer import kv_tcp_data, kv_tcp_import
from dualpace.engine.transfer.kv_shm_import import SharedKvPool
from dualpace.engine.transfer.kv_tcp_import import TcpDataServer, TcpImport, TcpWritten
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvTransferHeader
from dualpace.engine.transfer.migration import KvImporter, engine_kv_layout, migrate_out
from dualpace.engine.transfer.prefix_copy import send_cached_prefix
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.serve.engine_servicer import EngineServicer, data_path
from dualpace.serve.kv_shm_transport import SameHostKv
from dualpace.serve.kv_tcp_transport import TcpKvSender
from dualpace.serve.peers import PeerList
from dualpace.serve.security import ServerSecurity, load_tls
from dualpace.serve.server import channel_options, start_server
from dualpace.wire.engine_messages import kv_header_to_pb
from dualpace.wire.kv_tcp_messages import add_tcp_offer, tcp_answer_from_pb, tcp_written_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from tests.engine.test_migration import started, stop, wait_tokens
from tests.serve.test_security import _self_signed

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
HANG_GUARD_S = 30.0


class Served:
    async def start(self, tiny, tls=None) -> Served:
        self.source = await started(tiny, "src")
        self.target = await started(tiny, "dst", block_size=4)  # other runs than the source's 8-token blocks
        self.tls = tls
        self.data = await TcpDataServer.start("127.0.0.1", tls.data_server_context() if tls else None)
        self.kv = SameHostKv("tcp", SharedKvPool(None), tcp=self.data)
        servicer = EngineServicer(self.target[0], same_host=self.kv, tls=tls)
        self.server = await start_server(
            "127.0.0.1:0", lambda server: engine_pb2_grpc.add_EngineServicer_to_server(servicer, server),
            ["dualpace.v1.Engine"], security=ServerSecurity(tls=tls))
        return self

    def sender(self, faults: FaultConfig | None = None) -> TcpKvSender:
        return TcpKvSender(self.server.address, faults=faults or FaultConfig(), tls=self.tls)

    async def close(self) -> None:
        await self.server.stop(0)
        await self.kv.close()
        await stop(self.source, self.target)


def expected(tiny) -> list[int]:
    return OfflineGenerator(tiny).generate([PROMPT], [PARAMS])[0].output_token_ids


async def assert_continues_on_target(served, channel, request_id: str, tokens: list[int]) -> None:
    emitted = len(channel.output_token_ids)
    rest = [t async for update in served.target[0].channel(request_id).follow(emitted) for t in update.new_token_ids]
    assert channel.output_token_ids + rest == tokens
    assert served.source[0].load().kv_blocks_used == 0


async def assert_stays_on_source(tiny, served, channel) -> None:
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]
    assert tokens == expected(tiny)
    assert channel.finish_reason == FinishReason.LENGTH and channel.migrated_to is None
    for _ in range(300):  # the target drops the import when it sees the stream cancelled (its cleanup)
        if served.target[0].load().kv_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    assert served.target[0].load().kv_blocks_used == 0 and not served.target[0].core.scheduler.requests
    assert served.source[0].load().kv_blocks_used == 0


@pytest.mark.parametrize("receive", ["direct", "staging"])
async def test_kv_over_the_data_socket_continues_exactly(tiny, monkeypatch, receive):
    if receive == "staging":  # the target's pool taken for another dtype's: received via its staging buffer
        monkeypatch.setattr(kv_tcp_import, "DTYPE_NAMES", collections.defaultdict(lambda: "another"))
    served = await Served().start(tiny)
    try:
        channel = await served.source[0].add_request("t", PROMPT, PARAMS)
        await wait_tokens(channel, 4)
        sender = served.sender()
        stats = await migrate_out(served.source[0], "t", sender)
        assert sender.used_tcp and stats.target_engine == "dst"
        await assert_continues_on_target(served, channel, "t", expected(tiny))
        assert served.data.num_refused == 0
    finally:
        await served.close()


def _refused(port: int, hello: bytes) -> bool:
    """True when the data socket closes a connection that sent `hello` and a layer's worth of junk."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(hello)
        try:
            connection.sendall(b"\x7f" * 4096)
            return connection.recv(1) == b""
        except ConnectionResetError:
            return True


async def test_a_wrong_or_replayed_ticket_is_refused_and_writes_nothing(tiny):
    served = await Served().start(tiny)
    try:
        channel = await served.source[0].add_request("w", PROMPT, PARAMS)
        await wait_tokens(channel, 4)

        async def send(header, outgoing) -> str:
            async with grpc.aio.insecure_channel(served.server.address, options=channel_options()) as grpc_channel:
                call = engine_pb2_grpc.EngineStub(grpc_channel).ImportKv()
                await call.write(add_tcp_offer(kv_header_to_pb(header)))
                answer = tcp_answer_from_pb(await call.read())
                wrong = kv_tcp_data.MAGIC + bytes(a ^ 1 for a in answer.ticket)
                assert await asyncio.to_thread(_refused, answer.port, wrong)
                connection = await asyncio.to_thread(kv_tcp_data.connect, "127.0.0.1", answer.port, answer.ticket, 30)
                with connection:
                    checksums = await asyncio.to_thread(kv_tcp_data.send_layers, connection, outgoing.storage.k,
                                                        outgoing.storage.v, outgoing.slot_ids)
                replay = kv_tcp_data.MAGIC + answer.ticket
                assert await asyncio.to_thread(_refused, answer.port, replay)
                await call.write(tcp_written_to_pb(TcpWritten(tuple(checksums), commit=True)))
                committed = await call.read()
                await call.done_writing()
                return committed.committed.engine

        await migrate_out(served.source[0], "w", send)
        await assert_continues_on_target(served, channel, "w", expected(tiny))
        assert served.data.num_refused == 2
    finally:
        await served.close()


@pytest.mark.parametrize("faults", [FaultConfig(kv_corrupt_layer=1), FaultConfig(kv_cut_after_layers=1)],
                         ids=["corrupt_layer", "connection_cut"])
async def test_a_fault_on_the_data_socket_leaves_the_request_on_the_source(tiny, faults):
    served = await Served().start(tiny)
    try:
        channel = await served.source[0].add_request("f", PROMPT, PARAMS)
        await wait_tokens(channel, 3)
        with pytest.raises(Unavailable):
            await migrate_out(served.source[0], "f", served.sender(faults))
        await assert_stays_on_source(tiny, served, channel)
    finally:
        await served.close()


async def test_a_cancel_mid_stream_leaves_the_request_on_the_source(tiny, monkeypatch):
    streaming, cancelled = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    send_all = kv_tcp_data.send_all

    def held_send_all(connection, buffers):
        loop.call_soon_threadsafe(streaming.set)
        assert cancelled.wait(HANG_GUARD_S)  # the stream is open: the cancel lands in the middle of it
        send_all(connection, buffers)

    monkeypatch.setattr(kv_tcp_data, "send_all", held_send_all)
    receiving, freed_while_receiving, ending, problems = [0], [], threading.Event(), []
    receive_layers, cancel, end_receive = kv_tcp_data.receive_layers, KvImporter.cancel, TcpImport.close

    def watched_receive(*args):
        receiving[0] += 1
        try:
            return receive_layers(*args)
        finally:
            # A receive slow to notice the shutdown: it ends only once the target ends the import,
            # and after the event loop's next turn, so a target that freed the blocks without
            # awaiting the receive would free them while it still runs.
            if not ending.wait(HANG_GUARD_S):
                problems.append("the target never ended the import")
            turned = threading.Event()
            loop.call_soon_threadsafe(turned.set)
            turned.wait(HANG_GUARD_S)
            receiving[0] -= 1

    async def watched_end_receive(self):
        ending.set()
        await end_receive(self)

    async def watched_cancel(self):
        freed_while_receiving.append(receiving[0])
        await cancel(self)

    monkeypatch.setattr(kv_tcp_data, "receive_layers", watched_receive)
    monkeypatch.setattr(TcpImport, "close", watched_end_receive)
    monkeypatch.setattr(KvImporter, "cancel", watched_cancel)
    served = await Served().start(tiny)
    try:
        channel = await served.source[0].add_request("c", PROMPT, PARAMS)
        await wait_tokens(channel, 3)
        move = asyncio.ensure_future(migrate_out(served.source[0], "c", served.sender()))
        await streaming.wait()
        move.cancel()
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await move
        await assert_stays_on_source(tiny, served, channel)
        assert freed_while_receiving and not any(freed_while_receiving)  # the receive stopped before the free
        assert not problems, problems
    finally:
        await served.close()


async def test_an_unreachable_data_socket_fails_the_transfer_and_leaves_the_request_on_the_source(tiny, monkeypatch):
    def refused(*args):
        raise ConnectionRefusedError("refused (test)")

    monkeypatch.setattr(kv_tcp_data, "connect", refused)
    served = await Served().start(tiny)
    try:
        channel = await served.source[0].add_request("u", PROMPT, PARAMS)
        await wait_tokens(channel, 4)
        sender = served.sender()
        with pytest.raises(Unavailable, match="cannot reach its data socket"):
            await migrate_out(served.source[0], "u", sender)
        assert not sender.used_tcp
        await assert_stays_on_source(tiny, served, channel)
    finally:
        await served.close()


async def test_under_tls_the_data_socket_speaks_tls_and_refuses_strangers(tiny, tmp_path):
    cert, key = _self_signed(tmp_path, "engine")  # both engines' certificate, and their CA (mutual TLS)
    served = await Served().start(tiny, load_tls(str(cert), str(key), str(cert)))
    try:
        channel = await served.source[0].add_request("s", PROMPT, PARAMS)
        await wait_tokens(channel, 4)
        sender = served.sender()
        await migrate_out(served.source[0], "s", sender)
        assert sender.used_tcp
        await assert_continues_on_target(served, channel, "s", expected(tiny))
        # Plaintext, or TLS with a certificate the target does not trust, gets no further than the handshake.
        assert await asyncio.to_thread(_refused, served.data.port, kv_tcp_data.MAGIC + bytes(16))
        other_cert, other_key = _self_signed(tmp_path, "stranger")
        stranger = load_tls(str(other_cert), str(other_key), str(cert)).data_client_context()
        with pytest.raises(ssl.SSLError):  # the target refuses its certificate (at the handshake or first read)
            connection = await asyncio.to_thread(kv_tcp_data.connect, "127.0.0.1", served.data.port, bytes(16), 10,
                                                 stranger)
            with connection:
                connection.recv(1)
    finally:
        await served.close()


async def test_a_cache_only_copy_goes_over_the_data_socket_without_what_the_target_holds(tiny):
    """The host tier's copies (send_cached_prefix, as CopyPrefix and the offers run it): the KV after
    the tokens the target caches already goes over the data socket, into the target's own blocks (of
    another block size); a copy of what it holds sends nothing; the target then continues a request
    from the copied blocks exactly."""
    served = await Served().start(tiny)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        history = PROMPT + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 32 tokens: 4 source blocks of 8
        async for _ in (await served.source[0].add_request("h", history, params)).follow():
            pass  # finished: its full blocks stay cached on the source
        copies = []
        for pin_id, token_ids in (("pin-1", history[:16]), ("pin-2", history), ("pin-3", history)):
            sender = served.sender()
            copy = await send_cached_prefix(served.source[0], sender.send_cache, tuple(token_ids), pin_id)
            copies.append((copy.num_tokens, copy.num_sent_tokens, sender.used_tcp))
        assert copies == [(16, 16, True), (32, 16, True), (32, 0, False)]  # the held tokens are never sent
        prompt = history + [5]
        channel = await served.target[0].add_request("continued", prompt, params)
        tokens = [t async for update in channel.follow() for t in update.new_token_ids]
        assert channel.num_cached_tokens == 32
        assert tokens == OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
        assert served.source[0].load().kv_blocks_used == 0 and served.target[0].load().kv_blocks_used == 0
    finally:
        await served.close()


async def test_a_corrupt_cache_only_copy_is_refused_and_leaves_nothing(tiny):
    served = await Served().start(tiny)
    try:
        async for _ in (await served.source[0].add_request("h", PROMPT, SamplingParams(max_tokens=4))).follow():
            pass
        with pytest.raises(Unavailable, match="checksum mismatch"):
            await send_cached_prefix(served.source[0], served.sender(FaultConfig(kv_corrupt_layer=1)).send_cache,
                                     tuple(PROMPT), "pin")
        target = served.target[0].load()
        assert target.kv_blocks_used == 0 and target.kv_blocks_cached == 0
        assert served.source[0].load().kv_blocks_used == 0  # the pin was dropped
    finally:
        await served.close()


async def test_migrate_out_reports_the_data_path_the_kv_took(tiny):
    """MigrateOutResponse.transport: "tcp" for KV over the data socket (a MigrateOut through the
    source's servicer), "none" for a move without KV (the target recomputes the request)."""
    served = await Served().start(tiny)
    source = EngineServicer(served.source[0], same_host=SameHostKv("tcp", SharedKvPool(None)),
                            peers=PeerList([served.server.address]))
    try:
        channel = await served.source[0].add_request("kv", PROMPT, PARAMS)
        await wait_tokens(channel, 4)
        moved = await source.MigrateOut(engine_pb2.MigrateOutRequest(request_id="kv",
                                                                     target_address=served.server.address), None)
        assert (moved.transport, moved.target_engine) == ("tcp", "dst") and moved.total_bytes > 0
        await assert_continues_on_target(served, channel, "kv", expected(tiny))

        sender = served.sender()
        layout = engine_kv_layout(served.source[0])
        header = KvTransferHeader("no-kv", tuple(PROMPT), (), dataclasses.replace(PARAMS, seed=3), 0, layout, 0, "src")
        assert await sender(header, OutgoingKv(served.source[0].core.runner.kv, [])) == "dst"
        assert data_path(sender) == "none"
    finally:
        await source.same_host.close()
        await served.close()
