"""The sender's half of a same-host KV transfer: map the target's pool, copy under a lease.

Mapped pools are kept between transfers (mapping a pool again would fault in its pages
again), one per target socket, and dropped as soon as the target's watch connection ends
(it died or restarted), so a dead target's memory is not held alive here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from dataclasses import dataclass

from dualpace.engine.kv_shm_protocol import ShmReservation, ShmWritten
from dualpace.engine.kv_source import OutgoingKv
from dualpace.engine.kv_transfer import KvLayout
from dualpace.engine.same_host import fetch_fd, held_lease
from dualpace.engine.shm_kv_copy import INLINE_MAX_BYTES, copy_in_place, transfer_bytes
from dualpace.engine.shm_segment import MappedKvSegment
from dualpace.engine.worker_pools import KV_TRANSFER_WORKERS, pool
from dualpace.errors import InvalidArgument, Unavailable
from dualpace.faults import FaultConfig

log = logging.getLogger(__name__)


@dataclass
class _Mapped:
    token: bytes
    segment: MappedKvSegment
    watch: socket.socket


class MappedPools:
    """Target pools mapped by this engine, by the target's socket name."""

    def __init__(self):
        self._pools: dict[str, _Mapped] = {}

    @property
    def num_mapped(self) -> int:
        return len(self._pools)

    async def get(self, reservation: ShmReservation) -> MappedKvSegment:
        """The target's pool (mapped now or before); raises SameHostRefused / InvalidArgument."""
        name = reservation.socket_name
        mapped = self._pools.get(name)
        if mapped is not None and mapped.token == reservation.segment_token:
            return mapped.segment
        self.drop(name)
        fd, watch = await asyncio.to_thread(fetch_fd, name, reservation.segment_token)
        try:
            segment = MappedKvSegment.open(fd, reservation.segment_token)
        except BaseException:
            watch.close()
            raise
        self._pools[name] = _Mapped(reservation.segment_token, segment, watch)
        asyncio.get_running_loop().add_reader(watch.fileno(), self._on_watch, name)
        log.info("mapped the KV pool of @%s (%d MB)", name, segment.geometry.total_bytes // 2**20)
        return segment

    def drop(self, name: str) -> None:
        """Forget the mapping (its memory is unmapped once no copy under way still uses it)."""
        mapped = self._pools.pop(name, None)
        if mapped is not None:
            asyncio.get_running_loop().remove_reader(mapped.watch.fileno())
            mapped.watch.close()

    def close(self) -> None:
        for name in list(self._pools):
            self.drop(name)

    def _on_watch(self, name: str) -> None:
        mapped = self._pools.get(name)
        if mapped is None:
            return
        try:
            data = mapped.watch.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            log.info("the owner of @%s went away; unmapping its KV pool", name)
            self.drop(name)


def check_geometry(segment: MappedKvSegment, layout: KvLayout, reservation: ShmReservation,
                   num_tokens: int) -> None:
    """The target's pool holds this model's KV in this dtype, and the slots named are inside it."""
    geometry = segment.geometry
    ours = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype)
    theirs = (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, geometry.dtype)
    if ours != theirs:
        raise InvalidArgument("shm_reserved", f"target pool holds {theirs}, this transfer is {ours}")
    num_slots = geometry.num_blocks * geometry.block_size
    if len(reservation.slot_ids) != num_tokens or any(not 0 <= s < num_slots for s in reservation.slot_ids):
        raise InvalidArgument("shm_reserved.slot_ids", f"expected {num_tokens} slots below {num_slots}")


def _inject_fault(faults: FaultConfig, segment: MappedKvSegment, dst_slot_ids: list[int]) -> None:
    """Test-only faults of dualpace.faults, with "chunk N" read as "layer N" on this path."""
    flat = segment.k.view(segment.geometry.num_layers, -1, segment.geometry.num_kv_heads, segment.geometry.head_dim)
    if faults.kv_corrupt_chunk is not None and faults.kv_corrupt_chunk < segment.geometry.num_layers:
        flat[faults.kv_corrupt_chunk, dst_slot_ids[0]].view(-1)[0] += 1  # one value changed in transit
    if faults.kv_drop_chunk is not None and faults.kv_drop_chunk < segment.geometry.num_layers:
        flat[faults.kv_drop_chunk, dst_slot_ids[0]].fill_(-1.0)  # the layer's first token never arrived
    if faults.kv_cut_after is not None:
        raise Unavailable(f"fault injected: shared-memory KV transfer cut after {faults.kv_cut_after} layers")


async def write_in_place(segment: MappedKvSegment, reservation: ShmReservation, source: OutgoingKv,
                         faults: FaultConfig) -> ShmWritten:
    """Copy the request's KV into the target's reserved slots, holding the import's write lease.
    The lease ends only after the copy has stopped (also when this call is cancelled)."""
    storage = source.storage
    dst_slot_ids = list(reservation.slot_ids)
    stop = threading.Event()
    try:
        async with held_lease(reservation.socket_name, reservation.import_token):
            if transfer_bytes(storage, len(dst_slot_ids)) <= INLINE_MAX_BYTES:
                layer_crc32s = copy_in_place(storage.k, storage.v, source.slot_ids, segment.k, segment.v,
                                             dst_slot_ids)
            else:
                job = pool("kv-export", KV_TRANSFER_WORKERS).submit(
                    copy_in_place, storage.k, storage.v, source.slot_ids, segment.k, segment.v, dst_slot_ids, stop)
                try:
                    layer_crc32s = await asyncio.wrap_future(job)
                except BaseException:
                    stop.set()
                    concurrent.futures.wait([job])  # brief: the copy stops at its next run
                    raise
                finally:
                    job = None
            if faults.any:
                _inject_fault(faults, segment, dst_slot_ids)
                if faults.kv_shm_hold_ms:
                    await asyncio.sleep(faults.kv_shm_hold_ms / 1e3)  # the window the kill tests aim at
    finally:
        segment = None  # no reference to the mapping kept alive by a traceback (see MappedPools)
    return ShmWritten(tuple(layer_crc32s))
