"""The cross-host KV transport: gRPC carries the header, the reservation, the layer checksums and the
commit; the KV bytes go over the target's TCP data socket (dualpace.engine.transfer.kv_tcp_data).

Python gRPC moves bulk bytes at about 1 GB/s here whatever the messages, a few percent of memcpy; a
socket fed with views of the pool moved the same KV about twice as fast. The header offers the data
socket; the target answers with a port and a one-time ticket, or with the reason it declines. A
declined offer, a connection that cannot be made, or a failure after it (a corrupt layer, a dropped
connection, a cancel) fails the transfer with the two-phase rules intact: the request runs on the
source, the target frees its blocks. Where the target serves TLS (KvTcpReserved.tls) the connection is TLS with
this daemon's credentials, as its gRPC calls are.
"""

from __future__ import annotations

import dataclasses
import ssl
import time

import grpc

from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_tcp_import import TcpDeclined, TcpReservation, TcpWritten
from dualpace.engine.transfer.kv_tcp_send import send_over_data_socket
from dualpace.engine.transfer.kv_transfer import KvTransferHeader
from dualpace.engine.transfer.prefix_copy import SourceFrom
from dualpace.errors import Unavailable
from dualpace.serve.address import UNIX_PREFIX, data_socket_peer_host
from dualpace.serve.kv_transport import KvControlSender, _ended
from dualpace.wire.engine_messages import kv_header_to_pb
from dualpace.wire.kv_tcp_messages import add_tcp_offer, tcp_answer_from_pb, tcp_written_to_pb



class TcpKvSender(KvControlSender):
    """send(header, outgoing) for migrate_out: the KV over the target's data socket where it takes it."""

    def __init__(self, target_address: str, **kwargs):
        super().__init__(target_address, **kwargs)
        self.used_tcp = False  # the last transfer's KV went over the data socket
        self.phase_ms: dict[str, float] = {}  # the last transfer's phases (bench.data_plane reports them)

    @staticmethod
    def offers_tcp(header: KvTransferHeader) -> bool:
        """Wherever there is KV to send (a request moved without KV needs no data path)."""
        return header.num_computed_tokens > 0

    def _tls_for(self, answer: TcpReservation) -> ssl.SSLContext | None:
        """The TLS of the connection to the data socket (as on this daemon's gRPC calls to the target);
        raises OSError where the two sides' settings do not meet (then the transfer fails)."""
        if not answer.tls:
            return None
        if self.tls is None or self.target_address.startswith(UNIX_PREFIX):
            raise OSError("the data socket speaks TLS; this sender has no TLS to a TCP address of the target")
        return self.tls.data_client_context()

    async def __call__(self, header: KvTransferHeader, outgoing: OutgoingKv) -> str:
        self.used_tcp = False
        if not self.offers_tcp(header):
            return await super().__call__(header, outgoing)
        self.phase_ms = {}
        started = time.perf_counter()
        async with self._channel() as channel:
            call = self._open_import(channel)
            try:
                await self._write(call, add_tcp_offer(kv_header_to_pb(header)), "the header")
                answer = await self.expect_answer(call)
                self.phase_ms["reservation_ms"] = (time.perf_counter() - started) * 1e3
                return await self.send_answered(call, answer, header, outgoing)
            except BaseException:
                call.cancel()  # the target drops the partial import (once its receive stopped)
                raise

    async def send_cache(self, header: KvTransferHeader, source_from: SourceFrom) -> tuple[str, int]:
        """A cache-only import with skip_cached (dualpace.engine.transfer.prefix_copy.SendCache) over the
        data socket: the target answers the header with the leading tokens it holds, then with its
        socket; only the KV after those tokens is streamed. Returns (the target engine, held tokens)."""
        header = dataclasses.replace(header, skip_cached=True)
        async with self._channel() as channel:
            call = self._open_import(channel)
            try:
                await self._write(call, add_tcp_offer(kv_header_to_pb(header)), "the header")
                num_held = (await self._expect(call, "cache_held")).num_held_tokens
                answer = await self.expect_answer(call)
                if num_held >= header.num_computed_tokens:  # the target holds it all: nothing to send
                    return await self._prepare_and_commit(call), num_held
                return await self.send_answered(call, answer, header, source_from(num_held)), num_held
            except BaseException:
                call.cancel()  # the target drops the partial import and its hold on the shared blocks
                raise

    async def send_answered(self, call, answer: TcpReservation | TcpDeclined, header: KvTransferHeader,
                            outgoing: OutgoingKv) -> str:
        """After the target's answer to the offer: the KV over the data socket, then the commit."""
        if isinstance(answer, TcpDeclined):
            raise Unavailable(f"KV to {self.target_address}: the target declined its data socket: {answer.reason}")
        started = time.perf_counter()
        try:
            tls = self._tls_for(answer)
        except OSError as exc:
            raise Unavailable(f"KV to {self.target_address}: cannot reach its data socket (port {answer.port}): "
                              f"{exc}") from exc
        checksums = await send_over_data_socket(data_socket_peer_host(self.target_address), answer, outgoing,
                                                self.timeout_s, tls, self.faults, peer=self.target_address)
        self.phase_ms["stream_ms"] = (time.perf_counter() - started) * 1e3
        outgoing.safe_point()  # the last chance to back out (a cancelled MigrateOut): the commit follows
        await self._write(call, tcp_written_to_pb(TcpWritten(tuple(checksums), commit=True)), "tcp_written")
        committed = await self._expect(call, "committed")
        self.used_tcp = True
        self.phase_ms["verify_commit_ms"] = (time.perf_counter() - started) * 1e3 - self.phase_ms["stream_ms"]
        return committed.engine

    @staticmethod
    async def expect_answer(call, parse=tcp_answer_from_pb):
        """The target's answer to the header's offer (`parse` returns None for any other reply)."""
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError:  # the target ended the stream with an error status (e.g. no room)
            raise await _ended(call, "before answering the offer") from None
        if reply is grpc.aio.EOF:
            await call.wait_for_connection()
            raise await _ended(call, "before answering the offer")
        answer = parse(reply)
        if answer is None:
            raise Unavailable(f"KV import answered the offer with {reply.WhichOneof('kind')!r}")
        return answer
