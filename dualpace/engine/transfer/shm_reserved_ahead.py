"""Blocks reserved ahead: a sender's one standing reservation per target, for its next transfer.

After a transfer to a target over its pool's watch (dualpace.engine.transfer.shm_control), where the
target's reservation said `reserves_ahead`, the sender at once asks for the blocks of its next
transfer there: an import stream whose first message is a ShmReserveAhead (the layout, and the last
transfer's tokens and a block more), answered by a reservation, its write lease asked for ahead and
granted with it. The stream then waits. The next transfer that fits takes it: it holds the lease,
copies into the first slots at once, and sends its header and `written` + commit together; the
target hands the reserved blocks to the request (the rest freed) and commits. So the header's round
trip to the reservation (0.7-1.0 ms of a transfer on a 2-vCPU guest: two wake-ups and Python on
both sides) leaves the transfer's path.

The two-phase rules do not change: the blocks are reserved before a byte is written, nothing is
live before the commit, the lease ends before `written` leaves, and the target frees the blocks of
an import that ends uncommitted only once that lease has ended. A reservation ahead ends unused when
- the sender gives it back (not taken within RESERVE_AHEAD_MAX_AGE_S, replaced by a larger one, or
  its pools closed): it abandons the stream and ends the lease;
- the target ends it (no header within kv_shm_import.RESERVED_AHEAD_MAX_WAIT_S, a draining
  engine): the stream's end reaches the sender, which ends the lease;
- either side dies: the watch connection's end does both.
While it stands the target holds its blocks (no request can take them), but its load and its
kv_blocks_used gauge do not count them (Scheduler.num_used_blocks): they stand for the next import, as
free blocks would. A transfer whose reservation ended before its header left makes a fresh import
instead (nothing of it was committed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dualpace.engine.transfer.kv_shm_protocol import ShmReservation
from dualpace.engine.transfer.kv_transfer import KvLayout, KvTransferHeader
from dualpace.engine.transfer.shm_watch_leases import WatchLeases

log = logging.getLogger(__name__)

RESERVE_AHEAD_MAX_AGE_S = 2.0  # a reservation no transfer took by then is given back


@dataclass
class ReservedAhead:
    """One reservation ahead: its import stream (waiting for the header), the target's answer, and the
    write lease asked for under `ticket` over `leases` (granted with the answer)."""

    call: object  # a WatchImportCall (dualpace.serve.kv_shm_control) whose `stream` is an OutgoingStream
    reservation: ShmReservation
    layout: KvLayout
    num_tokens: int
    ticket: bytes
    leases: WatchLeases  # where the lease was asked for
    expiry: asyncio.TimerHandle | None = None

    @property
    def open(self) -> bool:
        """The target has not ended the import (its stream)."""
        return self.call.stream.code is None

    def fits(self, header: KvTransferHeader) -> bool:
        return self.open and header.layout == self.layout and 0 < header.num_computed_tokens <= self.num_tokens

    def end_lease(self) -> None:
        """End the lease asked for ahead, unless a copy holds it (that copy ends it)."""
        if self.expiry is not None:
            self.expiry.cancel()
        self.leases.withdraw(self.ticket)

    def give_back(self) -> None:
        """End it unused: the stream abandoned (the target drops the import once the lease ended)."""
        self.call.cancel()
        self.end_lease()


def first_slots(runs: tuple[tuple[int, int], ...], num_slots: int) -> tuple[tuple[int, int], ...]:
    """The (first slot, number of slots) runs of the first `num_slots` slots of `runs`."""
    cut, left = [], num_slots
    for start, length in runs:
        if left <= 0:
            break
        cut.append((start, min(length, left)))
        left -= length
    return tuple(cut)


class ReservationsAhead:
    """A sender's reservations ahead, at most one per target address (MappedPools.ahead)."""

    def __init__(self):
        self._held: dict[str, ReservedAhead] = {}
        self._making: dict[str, asyncio.Task] = {}

    def take(self, target: str, header: KvTransferHeader) -> ReservedAhead | None:
        """The target's reservation if it fits this transfer's KV; the caller's from now on (it ends the
        stream and the lease)."""
        held = self._held.get(target)
        if held is None or not held.fits(header):
            return None
        del self._held[target]
        held.expiry.cancel()
        return held

    def wants(self, target: str, num_tokens: int) -> bool:
        """Whether to reserve `num_tokens` ahead now: none is being made, and none as large is held."""
        held = self._held.get(target)
        return target not in self._making and (held is None or not held.open or held.num_tokens < num_tokens)

    def make(self, target: str, reserve: Callable[[], Awaitable[ReservedAhead | None]]) -> None:
        """Run `reserve` in the background; what it reserves replaces the target's reservation."""
        self._making[target] = asyncio.get_running_loop().create_task(self._make(target, reserve))

    async def _make(self, target: str, reserve: Callable[[], Awaitable[ReservedAhead | None]]) -> None:
        try:
            made = await reserve()
        except Exception as exc:  # noqa: BLE001 - the next transfer then reserves as it goes
            log.debug("no blocks reserved ahead at %s: %s", target, exc)
            return
        finally:
            self._making.pop(target, None)
        if made is None:
            return
        if not made.open:
            made.end_lease()
            return
        self.drop(target)
        made.expiry = asyncio.get_running_loop().call_later(RESERVE_AHEAD_MAX_AGE_S, self._expire, target, made)
        made.call.stream.on_end = lambda: self._lost(target, made)
        self._held[target] = made

    def _expire(self, target: str, made: ReservedAhead) -> None:
        if self._held.get(target) is made:
            del self._held[target]
            made.give_back()

    def _lost(self, target: str, made: ReservedAhead) -> None:
        """Its stream ended (the target ended it, or the watch connection did): the lease ends too."""
        if self._held.get(target) is made:
            del self._held[target]
        made.end_lease()

    def drop(self, target: str) -> None:
        held = self._held.pop(target, None)
        if held is not None:
            held.give_back()

    def close(self) -> None:
        for task in self._making.values():
            task.cancel()
        for target in list(self._held):
            self.drop(target)
