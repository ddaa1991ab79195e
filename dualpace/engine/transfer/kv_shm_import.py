"""The target's half of a same-host KV transfer: offer -> reservation, written -> verified.

The two-phase rules of dualpace.engine.transfer.migration hold unchanged: the sender writes only into
blocks reserved for this import, which no step reads until the commit; verification happens
before prepare answers; and a failure frees the reserved blocks — but only once the sender's
write lease has ended, so a sender still copying can never write into blocks that were
already handed to another request.

Verification during the copy (progress reports, ShmWritten.progress): a layer range the sender
reports finished is verified at once in the import workers, while the sender copies the next
ranges; the rest after its lease ended, as before. Nothing about what is visible changes (the
blocks stay the import's until the commit, which needs every layer verified). What the target
relies on is the sender's report being final, which it cannot check, exactly as it relies on the
sender not writing after its lease ended (the mapping stays; nothing stops a late write but the
sender's own code): a report is a lease's end for its layers. Session 8 left the overlap out for
that reason; a late write into a reported layer is a sender bug of the same kind as a write after
the lease, which neither check sees. What the check is for (a wrong slot, a skipped run, a cut or a
changed byte in the copy) is still found, since every committed byte is read here after the sender
declared it final, and compared with the checksum of its source.
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
            return "the target's KV pool is not in shared memory (--kv-transport grpc, or a device pool)"
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
        self._reported: dict[int, int] = {}  # layer -> checksum, of the progress reports
        self._checks: list[tuple[range, asyncio.Future]] = []  # their verification, under way

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
                              asks_lease_ahead=True, takes_progress=True)

    def progress(self, report: ShmWritten) -> None:
        """Layers the sender finished and will not write again: verified now, in the import workers,
        while it copies on (the result is looked at when it says written)."""
        if self._lease is None or self._written:
            raise InvalidArgument("shm_written.progress", "no shared-memory copy under way for this import")
        layers = range(report.first_layer, report.first_layer + len(report.layer_crc32s))
        num_layers = self.importer.progress.header.layout.num_layers
        if not layers or layers.stop > num_layers or any(layer in self._reported for layer in layers):
            raise InvalidArgument("shm_written.first_layer", f"layers {layers} reported twice or not in the model")
        self._reported.update(zip(layers, report.layer_crc32s))
        kv = self.importer.loop.core.runner.kv
        self._checks.append((layers, asyncio.ensure_future(
            run_in_pool("kv-import", layer_checksums, kv.k, kv.v, list(self.importer.slot_ids), layers))))

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
            if expected != actual or self._reported.get(layer, expected) != expected:
                raise InvalidArgument("shm_written.layer_crc32", f"checksum mismatch in layer {layer}")
        progress.accept_in_place()

    async def _landed(self, num_layers: int) -> list[int]:
        """The checksums of every layer over this import's blocks: those reported during the copy as
        their checks end, the others read now."""
        kv = self.importer.loop.core.runner.kv
        slot_ids = list(self.importer.slot_ids)
        if not self._checks and transfer_bytes(kv, len(slot_ids)) <= INLINE_MAX_BYTES:
            return layer_checksums(kv.k, kv.v, slot_ids)  # small: on the loop, at once
        rest = [layer for layer in range(num_layers) if layer not in self._reported]
        if len(rest) == num_layers:  # the import workers read their share of the layers in parallel
            ranges = layer_ranges(num_layers, KV_TRANSFER_WORKERS)
        else:  # what no report covered (none, from this sender): layer by layer
            ranges = [range(layer, layer + 1) for layer in rest]
        checks = self._checks + [(layers, asyncio.ensure_future(
            run_in_pool("kv-import", layer_checksums, kv.k, kv.v, slot_ids, layers))) for layers in ranges]
        parts = await asyncio.gather(*(check for _, check in checks))
        landed = [0] * num_layers
        for (layers, _), part in zip(checks, parts):
            landed[layers.start:layers.stop] = part
        return landed

    async def close(self) -> None:
        """Before importer.cancel: no write may still be under way into the blocks it frees. Shielded
        (this runs in the cleanup of a cancelled RPC)."""
        checks = [check for _, check in self._checks]
        if checks:  # reads of blocks about to be freed: let them end first
            await asyncio.shield(asyncio.gather(*checks, return_exceptions=True))
        if self._ticket is None or self._written:
            return
        lease = self.pool.server.revoke(self._ticket)
        if lease is not None:
            await asyncio.shield(lease.wait_ended())
