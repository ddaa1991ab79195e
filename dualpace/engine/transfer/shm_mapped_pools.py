"""The sender's cache of other engines' KV pools, mapped into this process: one mapping per pool.

Mapped pools are kept between transfers (mapping a pool again would fault its pages in
again), one per target socket, and dropped as soon as the target's watch connection ends (it
died or restarted), so a dead target's memory is not held alive here.

Rules, all on the event loop's thread:

- **One mapping per pool per process, made under a lock.** Transfers that need a pool not
  mapped yet wait for the one that maps it. (Before this, every waiting transfer mapped the pool
  itself and the last replaced the others' entries; the watch socket of a replaced entry was
  closed by garbage collection while the event loop still polled its descriptor, and uvloop's
  libuv aborts the process on such a descriptor: the sending engine died without a traceback
  when several hand-offs to one target started at once.)
- **A watch descriptor leaves the event loop before it is closed**, always.
- **The watch carries the write leases** of the copies into its pool (`lease()`,
  dualpace.engine.transfer.shm_watch_leases), so its end would end them: a mapping dropped while copies
  still use it closes its watch only after the last of them (unless the owner is gone already).
- **Counted users.** A copy holds its mapping through `using()`; a mapping that was dropped
  (the target went away, or restarted with another segment) is given to no new copy, and this
  cache lets go of it once its last copy ended. The memory itself is never unmapped by hand:
  `torch.frombuffer` tensors keep the mmap object alive but do not pin its buffer, so an
  explicit `mmap.close()` would leave them pointing at unmapped memory. The kernel unmaps it
  when the last tensor over it is gone, which with no copy running is at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dualpace.engine.transfer.kv_shm_protocol import ShmReservation
from dualpace.engine.transfer.same_host import SameHostRefused, fetch_fd
from dualpace.engine.transfer.shm_control import OutgoingStream
from dualpace.engine.transfer.shm_reserved_ahead import ReservationsAhead
from dualpace.engine.transfer.shm_segment import MappedKvSegment
from dualpace.engine.transfer.shm_watch_leases import WatchLeases

log = logging.getLogger(__name__)


@dataclass
class _Mapped:
    token: bytes
    segment: MappedKvSegment | None
    watch: socket.socket
    leases: WatchLeases
    num_users: int = 0
    dropped: bool = False

    def let_go(self) -> None:
        """The mapping's end, once no copy uses it (or its owner is gone): memory and watch."""
        self.segment = None
        self.watch.close()


def _close_fetched(fetch: asyncio.Future) -> None:
    if not fetch.cancelled() and fetch.exception() is None:
        fd, watch = fetch.result()
        os.close(fd)
        watch.close()


class MappedPools:
    """Target pools mapped by this engine, by the target's socket name."""

    def __init__(self, fetch: Callable[[str, bytes], tuple[int, socket.socket]] = fetch_fd):
        self._fetch = fetch  # blocking: (fd, watch connection); a test may count the calls
        self._pools: dict[str, _Mapped] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._num_in_use = 0
        # target address -> its pool (socket, token) and whether it takes leases asked for ahead
        self._control: dict[str, tuple[str, bytes, bool]] = {}
        self.ahead = ReservationsAhead()  # blocks reserved ahead in those pools, for the next transfers

    @property
    def num_mapped(self) -> int:
        """Pools held for future transfers (not counting dropped ones a copy still uses)."""
        return len(self._pools)

    @property
    def num_in_use(self) -> int:
        """Copies holding a mapping right now."""
        return self._num_in_use

    @contextlib.asynccontextmanager
    async def using(self, reservation: ShmReservation) -> AsyncIterator[MappedKvSegment]:
        """The target's pool (mapped now or before), held until the body ends; raises SameHostRefused /
        InvalidArgument when it cannot be mapped."""
        mapped = await self._mapping(reservation)
        mapped.num_users += 1
        self._num_in_use += 1
        try:
            yield mapped.segment
        finally:
            mapped.num_users -= 1
            self._num_in_use -= 1
            if mapped.dropped and mapped.num_users == 0:
                mapped.let_go()  # the last copy ended: let the memory go (and end the watch)

    @contextlib.asynccontextmanager
    async def lease(self, reservation: ShmReservation) -> AsyncIterator[None]:
        """The import's write lease, over the watch of the pool the caller holds (`using`); raises
        SameHostRefused when the owner refuses it or the mapping was dropped meanwhile."""
        mapped = self._pools.get(reservation.socket_name)
        if mapped is None or mapped.token != reservation.segment_token:
            raise SameHostRefused(f"no mapping of @{reservation.socket_name} to take a lease over")
        async with mapped.leases.held(reservation.import_token):
            yield

    def remember_control(self, target_address: str, reservation: ShmReservation) -> None:
        """After a transfer into that pool: the target takes control streams over its watch
        (`reservation.control_on_watch`), so its next transfers need no gRPC stream."""
        if reservation.control_on_watch and reservation.socket_name in self._pools:
            self._control[target_address] = (reservation.socket_name, reservation.segment_token,
                                             reservation.asks_lease_ahead)

    def control_stream(self, target_address: str) -> OutgoingStream | None:
        """A control stream to the target over the watch of its mapped pool; None where there is none
        (never mapped, the mapping dropped: its owner went away or restarted): gRPC then."""
        route = self._control.get(target_address)
        if route is None:
            return None
        mapped = self._pools.get(route[0])
        if mapped is None or mapped.token != route[1] or mapped.leases.closed:
            del self._control[target_address]
            return None
        return mapped.leases.open_stream()

    def ask_lease_ahead(self, target_address: str, ticket: bytes) -> WatchLeases | None:
        """Ask over the watch of the target's mapped pool, now, for the write lease of the import to
        come under `ticket` (ours: ShmOffer.lease_ticket), where the target takes that; None: not
        asked. The caller then withdraws it (`WatchLeases.withdraw`) unless a copy held it."""
        route = self._control.get(target_address)
        if route is None or not route[2]:
            return None
        mapped = self._pools.get(route[0])
        if mapped is None or mapped.token != route[1] or mapped.leases.closed:
            return None
        try:
            mapped.leases.ask(ticket)
        except SameHostRefused:
            return None
        return mapped.leases

    async def _mapping(self, reservation: ShmReservation) -> _Mapped:
        name = reservation.socket_name
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            mapped = self._pools.get(name)
            if mapped is not None and mapped.token == reservation.segment_token:
                return mapped
            self.drop(name)  # another segment under that name: its owner restarted
            fetch = asyncio.ensure_future(asyncio.to_thread(self._fetch, name, reservation.segment_token))
            try:
                fd, watch = await asyncio.shield(fetch)
            except asyncio.CancelledError:
                fetch.add_done_callback(_close_fetched)  # the thread still hands over an fd: close it
                raise
            try:
                segment = MappedKvSegment.open(fd, reservation.segment_token)
            except BaseException:
                watch.close()
                raise
            mapped = self._pools[name] = _Mapped(reservation.segment_token, segment, watch, WatchLeases(watch))
            asyncio.get_running_loop().add_reader(watch.fileno(), self._on_watch, name, mapped)
            log.info("mapped the KV pool of @%s (%d MB)", name, segment.geometry.total_bytes // 2**20)
            return mapped

    def drop(self, name: str, owner_gone: bool = False) -> None:
        """Forget the mapping: no new copy gets it; the memory and the watch go once no copy under way
        uses it (the watch at once when the owner is gone: its leases ended with it)."""
        mapped = self._pools.pop(name, None)
        if mapped is None:
            return
        mapped.dropped = True
        asyncio.get_running_loop().remove_reader(mapped.watch.fileno())  # before the close, always
        mapped.leases.close()
        if owner_gone or mapped.num_users == 0:
            mapped.let_go()

    def close(self) -> None:
        self.ahead.close()
        for name in list(self._pools):
            self.drop(name)
        self._locks.clear()
        self._control.clear()

    def _on_watch(self, name: str, mapped: _Mapped) -> None:
        if self._pools.get(name) is not mapped:
            return  # that watch was already dropped
        if not mapped.leases.readable():
            log.info("the owner of @%s went away; unmapping its KV pool", name)
            self.drop(name, owner_gone=True)
