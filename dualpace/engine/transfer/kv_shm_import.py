"""The target's half of a same-host KV transfer: offer -> reservation, written -> verified.

The two-phase rules of dualpace.engine.transfer.migration hold unchanged: the sender writes only into
blocks reserved for this import, which no step reads until the commit; verification happens
before prepare answers; and a failure frees the reserved blocks — but only once the sender's
write lease has ended, so a sender still copying can never write into blocks that were
already handed to another request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from dualpace.engine.transfer.kv_shm_protocol import ShmDeclined, ShmOffer, ShmReservation, ShmWritten
from dualpace.engine.transfer.migration import KvImporter
from dualpace.engine.transfer.same_host import Lease, TicketServer, boot_id
from dualpace.engine.transfer.shm_kv_copy import INLINE_MAX_BYTES, layer_checksums, layer_ranges, transfer_bytes
from dualpace.engine.transfer.shm_segment import SharedKvMemory
from dualpace.engine.transfer.worker_pools import KV_TRANSFER_WORKERS, run_in_pool
from dualpace.errors import InvalidArgument

log = logging.getLogger(__name__)


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
        return ShmReservation(self.pool.server.name, self.pool.segment_ticket, self._ticket,
                              tuple(self.importer.slot_ids), accepts_written_with_commit=True,
                              lease_on_watch=True, control_on_watch=self.pool.server.stream_handler is not None,
                              asks_lease_ahead=True)

    async def written(self, written: ShmWritten) -> None:
        """Verify what landed in the reserved blocks; then the import is complete (prepare may follow)."""
        if self._lease is None:
            raise InvalidArgument("shm_written", "no shared-memory reservation was made for this import")
        progress = self.importer.progress
        layout = progress.header.layout
        if len(written.layer_crc32s) != layout.num_layers:
            raise InvalidArgument("shm_written.layer_crc32",
                                  f"{len(written.layer_crc32s)} checksums for {layout.num_layers} layers")
        self.pool.server.revoke(self._ticket)
        await self._lease.wait_ended()  # the sender closed it before saying written: normally at once
        self.importer.marks.append(("lease_ended", time.perf_counter()))
        self._written = True
        landed = await self._landed(layout.num_layers)
        for layer, (expected, actual) in enumerate(zip(written.layer_crc32s, landed)):
            if expected != actual:
                raise InvalidArgument("shm_written.layer_crc32", f"checksum mismatch in layer {layer}")
        progress.accept_in_place()

    async def _landed(self, num_layers: int) -> list[int]:
        """The checksums of every layer over this import's blocks (the import workers read their
        share of the layers in parallel; a small transfer on the loop, at once)."""
        kv = self.importer.loop.core.runner.kv
        slot_ids = list(self.importer.slot_ids)
        if transfer_bytes(kv, len(slot_ids)) <= INLINE_MAX_BYTES:
            return layer_checksums(kv.k, kv.v, slot_ids)
        ranges = layer_ranges(num_layers, KV_TRANSFER_WORKERS)
        parts = await asyncio.gather(*(run_in_pool("kv-import", layer_checksums, kv.k, kv.v, slot_ids, layers)
                                       for layers in ranges))
        landed = [0] * num_layers
        for layers, part in zip(ranges, parts):
            landed[layers.start:layers.stop] = part
        return landed

    async def close(self) -> None:
        """Before importer.cancel: no write may still be under way into the blocks it frees. Shielded
        (this runs in the cleanup of a cancelled RPC)."""
        if self._ticket is None or self._written:
            return
        lease = self.pool.server.revoke(self._ticket)
        if lease is not None:
            await asyncio.shield(lease.wait_ended())
