"""The target's half of a same-host KV transfer: offer -> reservation, written -> committed.

The two-phase rules of dualpace.engine.transfer.migration hold unchanged: the sender writes only into
blocks reserved for this import, which no step reads until the commit; and a failure frees the
reserved blocks, but only once the sender's write lease has ended, so a sender still copying can
never write into blocks that were already handed to another request.

What lands is trusted, not read back. The sender's copy computes each layer's CRC32C as it writes
(dualpace.engine.transfer.shm_kv_copy: one pass over the bytes) and the target accepts them without
a second pass over its blocks. That is safe here because of what can go wrong between two
processes of one user on one kernel, writing into a memfd that only ticket holders map:
- nothing is in transit: the sender's stores are the target's memory (no wire, no buffer, no
  second copy that could flip a bit; the memory's own errors are the hardware's ECC's to catch);
- a sender killed or failing mid-copy (a torn write) never sends `written`: its lease ends with
  its watch connection or its copy's failure, the import is dropped and its blocks are freed
  only after that. `written` (with the commit, where the sender sends them together) is the
  commit record: it leaves the sender only after every layer was copied and the lease ended;
- a `written` that does not match the reservation is refused (INVALID_ARGUMENT): checksums for
  another number of layers than reserved (a sender that wrote, or says it wrote, fewer layers),
  or a `written` from a sender that never held this import's write lease (so never wrote it).
What a read-back pass would still catch is a sender that copies wrong bytes and checksums them
as right, a bug of this same code on both ends; it cost as much as the copy itself (a second
pass over every byte, 3.6 ms of a 9.4 ms 1024-token transfer on the Xeon measured). The data
socket (kv_tcp_import), whose bytes do cross a wire and a kernel buffer, still verifies them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dualpace.engine.transfer.kv_shm_protocol import ShmDeclined, ShmOffer, ShmReservation, ShmWritten
from dualpace.engine.transfer.migration import KvImporter
from dualpace.engine.transfer.same_host import Lease, TicketServer, boot_id
from dualpace.engine.transfer.shm_segment import SharedKvMemory
from dualpace.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

# How long blocks reserved ahead (KvImporter.reserve_ahead) wait for their transfer's header before the
# import ends and frees them. Senders give theirs back sooner (shm_reserved_ahead.RESERVE_AHEAD_MAX_AGE_S).
RESERVED_AHEAD_MAX_WAIT_S = 10.0


async def import_messages(requests: AsyncIterator, importer: KvImporter) -> AsyncIterator:
    """An import stream's messages, in order; while its blocks are reserved ahead and its header has
    not come, at most RESERVED_AHEAD_MAX_WAIT_S for the next one (then Unavailable: the import ends)."""
    iterator = aiter(requests)
    while True:
        try:
            if importer.reserved_ahead and importer.progress is None:
                async with asyncio.timeout(RESERVED_AHEAD_MAX_WAIT_S):
                    message = await anext(iterator)
            else:  # no timer on the other messages' path
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Unavailable(f"no transfer took the blocks reserved ahead within {RESERVED_AHEAD_MAX_WAIT_S:g} s; "
                              "they are freed") from None
        yield message


@dataclass
class SharedKvPool:
    """This engine's KV pool as other daemons on the host may write it (None parts: it may not)."""

    memory: SharedKvMemory | None
    server: TicketServer | None = None
    boot_id: str | None = None
    segment_ticket: bytes | None = None

    @classmethod
    async def start(cls, memory: SharedKvMemory | None) -> SharedKvPool:
        """Serve the pool's memfd on an abstract socket (when the pool is shared at all)."""
        if memory is None or memory.fd is None:
            return cls(None)
        server = TicketServer("kv")
        await server.start()
        # The segment's own token is its fd ticket: whoever maps it checks it in the header.
        pool = cls(memory, server, boot_id(), server.share_fd(memory.fd, memory.token))
        log.info("KV pool shared on this host through @%s (%d MB)", server.name,
                 memory.geometry.total_bytes // 2**20)
        return pool

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    def decline_reason(self, offer: ShmOffer) -> str | None:
        if self.memory is None or self.server is None:
            return "the target's KV pool is not in shared memory (--kv-transport tcp, or a device pool)"
        if self.boot_id is None or offer.boot_id != self.boot_id:
            return "another host (boot ids differ)"
        return None


class ShmImport:
    """One import's shared-memory side, beside its KvImporter."""

    def __init__(self, pool: SharedKvPool, importer: KvImporter):
        self.pool = pool
        self.importer = importer
        self._ticket: bytes | None = None
        self._lease: Lease | None = None
        self._written = False

    def answer(self, offer: ShmOffer) -> ShmReservation | ShmDeclined:
        """After importer.begin reserved the blocks: where the sender may write them, or why not."""
        reason = self.pool.decline_reason(offer)
        if reason is not None:
            return ShmDeclined(reason)
        # Under the sender's own ticket where it named one: a lease it asked for ahead is granted now.
        self._ticket, self._lease = self.pool.server.open_lease(offer.lease_ticket)
        on_watch = self.pool.server.stream_handler is not None
        return ShmReservation(self.pool.server.name, self.pool.segment_ticket, self._ticket,
                              self.importer.slot_runs, accepts_written_with_commit=True,
                              lease_on_watch=True, control_on_watch=on_watch, asks_lease_ahead=True,
                              reserves_ahead=on_watch)

    async def written(self, written: ShmWritten) -> None:
        """The sender's commit record: it copied every layer and ended its lease; then the import is
        complete (prepare may follow). Its bytes are not read back (see the module's docstring)."""
        if self._lease is None:
            raise InvalidArgument("shm_written", "no shared-memory reservation was made for this import")
        progress = self.importer.progress
        layout = progress.header.layout
        if len(written.layer_crc32s) != layout.num_layers:
            raise InvalidArgument("shm_written.layer_crc32",
                                  f"{len(written.layer_crc32s)} checksums for {layout.num_layers} layers")
        self.pool.server.revoke(self._ticket)
        if not self._lease.granted:
            raise InvalidArgument("shm_written", "the sender never held this import's write lease")
        await self._lease.wait_ended()  # the sender closed it before saying written: normally at once
        self.importer.marks.append(("lease_ended", time.perf_counter()))
        self._written = True
        progress.accept_in_place()

    async def close(self) -> None:
        """Before importer.cancel: no write may still be under way into the blocks it frees. Shielded
        (this runs in the cleanup of a cancelled RPC)."""
        if self._ticket is None or self._written:
            return
        lease = self.pool.server.revoke(self._ticket)
        if lease is not None:
            await asyncio.shield(lease.wait_ended())
