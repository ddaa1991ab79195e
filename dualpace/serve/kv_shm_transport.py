"""The same-host KV transport: gRPC carries the header, the slots, checksums, prepare and commit;
the bytes go straight from this engine's pool into the target's reserved blocks. Once a
transfer has mapped the target's pool, the next ones to that target send those same messages
over the pool's watch connection instead of a gRPC stream (dualpace.engine.transfer.shm_control),
and each one reserves the blocks of the next ahead (dualpace.engine.transfer.shm_reserved_ahead): a
transfer that fits them copies at once and sends its header with written + commit.

The header offers shared memory; the target answers with a reservation (it proved nothing
yet: the sender then maps the pool it names and checks the token in its header) or with the
reason it declines; the same header offers the target's TCP data socket, which it answers with
instead where shared memory is not for it (another host, a private pool). Where the pool cannot be
used after all (it cannot be mapped, other geometry) the transfer fails with the two-phase rules
intact, and that target is offered only the data socket for a minute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field


from dualpace.engine.transfer.kv_shm_import import SharedKvPool, ShmImport
from dualpace.engine.transfer.kv_shm_protocol import ShmDeclined, ShmOffer, ShmReservation, ShmReserveAhead, ShmWritten
from dualpace.engine.transfer.kv_shm_send import MappedPools, check_geometry, write_in_place
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_tcp_import import TcpDataServer, TcpDeclined, TcpImport, TcpReservation
from dualpace.engine.transfer.kv_transfer import KvLayout, KvTransferHeader
from dualpace.engine.transfer.migration import KvImporter
from dualpace.engine.transfer.same_host import SameHostRefused, boot_id, new_ticket
from dualpace.engine.transfer.shm_reserved_ahead import ReservedAhead, first_slots
from dualpace.errors import InvalidArgument, Unavailable
from dualpace.faults import FaultConfig
from dualpace.serve.kv_shm_control import WatchImportCall
from dualpace.serve.kv_tcp_transport import TcpKvSender
from dualpace.serve.kv_transport import KvControlSender
from dualpace.serve.peer_channels import PeerChannels
from dualpace.serve.security import TlsConfig
from dualpace.wire.engine_messages import kv_header_to_pb
from dualpace.wire.kv_shm_messages import (
    kv_header_with_offer_to_pb,
    shm_answer_from_pb,
    shm_reserve_ahead_to_pb,
    shm_written_to_pb,
)
from dualpace.wire.kv_tcp_messages import add_tcp_offer, tcp_answer_from_pb
from dualpace.wire.v1 import engine_pb2

log = logging.getLogger(__name__)

# auto: shared memory where the target is on this host, else the target's TCP data socket;
# tcp: the data socket even on this host (the KV pool stays private).
KV_TRANSPORTS = ("auto", "tcp")
DECLINE_MEMORY_S = 60.0  # a target that declined is offered shared memory again after this


class ReservedAheadEnded(Exception):
    """The target ended a reservation ahead before the transfer's header left: reserve anew."""


class SameHostKvSender(TcpKvSender):
    """send(header, chunks) for migrate_out: shared memory when the target proves it is on this host;
    else its TCP data socket (offered in the same header); neither fails the transfer."""

    def __init__(self, target_address: str, pools: MappedPools, declined_until: dict[str, float],
                 channels: PeerChannels | None = None, **kwargs):
        super().__init__(target_address, channels=channels, **kwargs)  # channels None: one per transfer
        self.pools = pools
        self.declined_until = declined_until  # target address -> monotonic time; shared by the engine's senders
        self.used_shm = False  # for the caller's logs and the tests
        self.used_watch_control = False  # the last transfer's messages went over the pool's watch, not gRPC
        self.used_reserved_ahead = False  # the last transfer went into blocks reserved ahead (shm_reserved_ahead)
        self.phase_ms: dict[str, float] = {}  # the last transfer's phases, in order
        self.marks: list[tuple[str, float]] = []  # the last transfer's events (name, perf_counter s)

    def _offer(self, header: KvTransferHeader) -> ShmOffer | None:
        host = boot_id()
        if host is None or header.num_computed_tokens == 0:
            return None  # nothing to copy (a request moved without KV goes as before)
        if time.monotonic() < self.declined_until.get(self.target_address, 0.0):
            return None
        return ShmOffer(host)

    async def __call__(self, header: KvTransferHeader, chunks: OutgoingKv) -> str:
        offer = self._offer(header)
        if offer is None:
            return await super().__call__(header, chunks)
        laps = self.phase_ms = {}  # where the time of this transfer went (bench.data_plane reports it)
        self.marks = [("start", time.perf_counter())]
        lap = _lap_timer(laps, self.marks)
        self.used_watch_control = self.used_reserved_ahead = False
        reserved = self.pools.ahead.take(self.target_address, header)
        if reserved is not None:
            try:
                return await self._transfer_reserved(reserved, header, chunks, lap)
            except ReservedAheadEnded:  # before its header left: nothing of it committed
                log.debug("KV to %s: the target ended the blocks reserved ahead; reserving anew", self.target_address)
                self.used_reserved_ahead = False
        try:
            control = self.pools.control_stream(self.target_address)
        except SameHostRefused:
            control = None
        if control is not None:  # this host, proven, pool mapped: the messages go over its watch
            self.used_watch_control = True
            call = WatchImportCall(control, engine_pb2.ImportKvReply.FromString)
            self.marks.append(("stream_opened", time.perf_counter()))
            # The import's lease is asked for right after the header, under a ticket of ours that
            # the target then names it by: its answer comes with the reservation, not a round trip later.
            offer = dataclasses.replace(offer, lease_ticket=new_ticket())
            return await self._transfer(call, header, chunks, offer, lap)
        async with self._channel() as channel:
            call = self._open_import(channel)
            self.marks.append(("stream_opened", time.perf_counter()))
            return await self._transfer(call, header, chunks, offer, lap)

    async def _transfer(self, call, header: KvTransferHeader, chunks: OutgoingKv, offer: ShmOffer, lap) -> str:
        """Header to committed on one import stream: a gRPC call, or a WatchImportCall (where the offer
        names a lease ticket, that lease is asked for ahead; withdrawn at the end unless the copy held it)."""
        asked = None
        try:
            if offer.lease_ticket is not None:  # the ask leaves with the header, in one send
                asked = self.pools.ask_lease_ahead(self.target_address, offer.lease_ticket)
            message = kv_header_with_offer_to_pb(header, offer)
            await self._write(call, add_tcp_offer(message) if self.offers_tcp(header) else message,
                              "the header")
            lap("header_ms")
            answer = await self._expect_answer(call)
            lap("reservation_ms")
            if isinstance(answer, (TcpReservation, TcpDeclined)):  # another host: shared memory declined
                self.declined_until[self.target_address] = time.monotonic() + DECLINE_MEMORY_S
                return await self.send_answered(call, answer, header, chunks)
            if isinstance(answer, ShmDeclined):  # and no data socket offered: nothing to send the KV over
                self.declined_until[self.target_address] = time.monotonic() + DECLINE_MEMORY_S
                raise Unavailable(f"KV to {self.target_address}: the target declined shared memory: {answer.reason}")
            written = await self._write_in_place(call, answer, header, chunks)
            lap("lease_and_copy_ms")
            with_commit = answer.accepts_written_with_commit
            if with_commit:
                chunks.safe_point()  # the last chance to back out (a cancelled MigrateOut): commit follows
                written = dataclasses.replace(written, commit=True)
            await self._write(call, shm_written_to_pb(written), "shm_written")
            self.used_shm = True
            lap("written_ms")
            # with commit: the target verified, prepared and committed on that one message
            engine = ((await self._expect(call, "committed")).engine if with_commit
                      else await self._prepare_and_commit(call))
            self.pools.remember_control(self.target_address, answer)
            lap("verify_prepare_commit_ms")
            self._reserve_next(header, answer)
            if log.isEnabledFor(logging.DEBUG):  # its dict built for nothing: 0.05 ms cold
                log.debug("KV to %s: %s", self.target_address, {k: round(v, 3) for k, v in self.phase_ms.items()})
            return engine
        except BaseException:
            call.cancel()  # the target drops the partial import (once our write lease has ended)
            raise
        finally:
            if asked is not None:  # not held (declined, failed before the copy, another ticket): end it
                asked.withdraw(offer.lease_ticket)

    async def _transfer_reserved(self, reserved: ReservedAhead, header: KvTransferHeader, chunks: OutgoingKv,
                                 lap) -> str:
        """Into blocks reserved ahead (shm_reserved_ahead): the copy at once, then the header and
        written + commit together, answered by committed. Raises ReservedAheadEnded where the target
        ended the reservation before the header left."""
        self.used_watch_control = self.used_reserved_ahead = True
        call = reserved.call
        answer = dataclasses.replace(reserved.reservation,
                                     slot_runs=first_slots(reserved.reservation.slot_runs, header.num_computed_tokens))
        try:
            try:
                written = await self._write_in_place(call, answer, header, chunks)
            except SameHostRefused:  # the lease taken back (the target ended the reservation) or the watch gone
                raise ReservedAheadEnded() from None
            lap("lease_and_copy_ms")
            chunks.safe_point()  # the last chance to back out (a cancelled MigrateOut): commit follows
            if not reserved.open:  # checked and sent with no await between: the header reaches its import
                raise ReservedAheadEnded()
            # One send, with the lease's end: the target checks the header, hands the blocks to the
            # request, verifies and commits, woken once.
            await self._write(call, kv_header_to_pb(header), "the header and shm_written",
                              shm_written_to_pb(dataclasses.replace(written, commit=True)))
            self.used_shm = True
            lap("written_ms")
            engine = (await self._expect(call, "committed")).engine
            lap("verify_prepare_commit_ms")
            self._reserve_next(header, reserved.reservation)
            return engine
        except BaseException:
            call.cancel()  # the target drops the import (once our write lease has ended)
            raise
        finally:
            reserved.end_lease()  # asked ahead and not held (a failure before the copy): end it

    def _reserve_next(self, header: KvTransferHeader, answer: ShmReservation) -> None:
        """After a transfer over the target's watch: blocks for the next one, reserved in the background
        (the transfer's tokens and a block more)."""
        block_size = header.layout.block_size
        num_tokens = -(-header.num_computed_tokens // block_size) * block_size + block_size
        if answer.reserves_ahead and self.pools.ahead.wants(self.target_address, num_tokens):
            self.pools.ahead.make(self.target_address, lambda: self._reserve_ahead(header.layout, num_tokens))

    async def _reserve_ahead(self, layout: KvLayout, num_tokens: int) -> ReservedAhead | None:
        try:
            control = self.pools.control_stream(self.target_address)
        except SameHostRefused:
            return None
        if control is None:
            return None
        ticket = new_ticket()
        leases = self.pools.ask_lease_ahead(self.target_address, ticket)
        if leases is None:
            control.abandon()
            return None
        call = WatchImportCall(control, engine_pb2.ImportKvReply.FromString)
        try:
            ahead = ShmReserveAhead(layout, num_tokens, ShmOffer(boot_id(), ticket))
            await self._write(call, shm_reserve_ahead_to_pb(ahead), "the reservation ahead")
            answer = await self._expect_answer(call)
            if not isinstance(answer, ShmReservation):
                raise Unavailable(f"KV to {self.target_address}: no reservation ahead: {answer}")
        except BaseException:
            call.cancel()
            leases.withdraw(ticket)
            raise
        return ReservedAhead(call, answer, layout, num_tokens, ticket, leases)

    async def _write_in_place(self, call, answer: ShmReservation, header: KvTransferHeader,
                              chunks: OutgoingKv) -> ShmWritten:
        """Copy into the target's reserved blocks. Where its pool cannot be used, raises Unavailable
        (the transfer fails; the next ones to that target go over its data socket)."""
        async with contextlib.AsyncExitStack() as held:
            try:
                segment = await held.enter_async_context(self.pools.using(answer))  # held until the copy ends
                check_geometry(segment, header.layout, answer, header.num_computed_tokens)
            except (SameHostRefused, InvalidArgument) as exc:
                self.declined_until[self.target_address] = time.monotonic() + DECLINE_MEMORY_S
                raise Unavailable(f"KV to {self.target_address}: cannot use its shared pool: {exc}") from exc
            try:
                lease = self.pools.lease(answer) if answer.lease_on_watch else None  # else a connection of its own
                self.marks.append(("mapped", time.perf_counter()))
                return await write_in_place(segment, answer, chunks, self.faults, lease, self.marks)
            finally:
                # No reference to the mapping may outlive the call in a traceback: once the target is
                # gone and the pool dropped, the memory must go back to the kernel at once.
                segment = None

    async def _expect_answer(self, call):
        """The answer to the header's offers: a shared-memory reservation or refusal, or (another host)
        the data socket's."""
        return await self.expect_answer(call, lambda reply: shm_answer_from_pb(reply) or tcp_answer_from_pb(reply))


def _lap_timer(laps: dict[str, float], marks: list[tuple[str, float]]):
    """lap(name): records the milliseconds since the previous lap (or since this call) under name,
    and the moment itself in marks."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        laps[name] = (now - last[0]) * 1e3
        marks.append((name.removesuffix("_ms"), now))
        last[0] = now
    return lap


@dataclass
class SameHostKv:
    """An engine's side of same-host KV transfers, as sender and as target."""

    transport: str  # one of KV_TRANSPORTS
    pool: SharedKvPool  # this engine's pool as other daemons may write it
    mapped: MappedPools = field(default_factory=MappedPools)
    channels: PeerChannels = field(default_factory=PeerChannels)
    declined_until: dict[str, float] = field(default_factory=dict)
    tcp: TcpDataServer | None = None  # this engine's KV data socket (None: in-process tests only)

    def sender(self, target_address: str, faults: FaultConfig, auth_token: str | None,
               tls: TlsConfig | None = None) -> KvControlSender:
        if self.transport == "tcp":
            return TcpKvSender(target_address, faults=faults, auth_token=auth_token, tls=tls, channels=self.channels)
        return SameHostKvSender(target_address, self.mapped, self.declined_until, self.channels, faults=faults,
                                auth_token=auth_token, tls=tls)

    def importer_side(self, importer: KvImporter) -> ShmImport:
        return ShmImport(self.pool, importer)

    def tcp_side(self, importer: KvImporter) -> TcpImport:
        return TcpImport(self.tcp, importer)

    async def close(self) -> None:
        self.mapped.close()
        await self.channels.close()
        await self.pool.close()
        if self.tcp is not None:
            await self.tcp.close()
