"""The sender's half of a same-host KV transfer: check the target's mapped pool, copy under a lease.

The mapping itself comes from MappedPools (dualpace.engine.transfer.shm_mapped_pools): one per target
pool per process, held by each copy for as long as it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time

from dualpace.engine.transfer.kv_shm_protocol import ShmReservation, ShmWritten
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvLayout
from dualpace.engine.transfer.same_host import held_lease
from dualpace.engine.transfer.shm_kv_copy import INLINE_MAX_BYTES, copy_in_place, runs_into, transfer_bytes
from dualpace.engine.transfer.shm_mapped_pools import MappedPools  # noqa: F401  (its callers' one import)
from dualpace.engine.transfer.shm_segment import MappedKvSegment
from dualpace.engine.transfer.worker_pools import KV_TRANSFER_WORKERS, pool
from dualpace.errors import InvalidArgument, Unavailable
from dualpace.faults import FaultConfig

log = logging.getLogger(__name__)

__all__ = ["MappedPools", "check_geometry", "write_in_place"]


def check_geometry(segment: MappedKvSegment, layout: KvLayout, reservation: ShmReservation,
                   num_tokens: int) -> None:
    """The target's pool holds this model's KV in this dtype, and the slots named are inside it."""
    geometry = segment.geometry
    ours = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype)
    theirs = (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, geometry.dtype)
    if ours != theirs:
        raise InvalidArgument("shm_reserved", f"target pool holds {theirs}, this transfer is {ours}")
    num_slots = geometry.num_blocks * geometry.block_size
    runs = reservation.slot_runs
    if (sum(length for _, length in runs) != num_tokens
            or any(length < 1 or start < 0 or start + length > num_slots for start, length in runs)):
        raise InvalidArgument("shm_reserved.slot_runs", f"expected {num_tokens} slots below {num_slots}")


def _inject_fault(faults: FaultConfig, segment: MappedKvSegment, first_dst_slot: int,
                  layer_crc32s: list[int]) -> list[int]:
    """Test-only faults of dualpace.faults, as the failures one host can have: nothing is in transit
    to corrupt, so a corrupt or dropped layer is a sender that says written over a copy it did not
    finish. Returns the checksums it reports.
    - kv_corrupt_layer N: a torn write: layer N's first token is left half written and the record
      covers the layers before it only;
    - kv_drop_layer N: layer N's first token never written, and that layer left out of the record."""
    flat = segment.k.view(segment.geometry.num_layers, -1, segment.geometry.num_kv_heads, segment.geometry.head_dim)
    layers = range(segment.geometry.num_layers)
    if faults.kv_corrupt_layer in layers:
        token = flat[faults.kv_corrupt_layer, first_dst_slot].view(-1)
        token[:len(token) // 2].fill_(-1.0)
        layer_crc32s = layer_crc32s[:faults.kv_corrupt_layer]
    if faults.kv_drop_layer in layers:
        flat[faults.kv_drop_layer, first_dst_slot].fill_(-1.0)
        layer_crc32s = layer_crc32s[:faults.kv_drop_layer] + layer_crc32s[faults.kv_drop_layer + 1:]
    return layer_crc32s


async def _copy_in_worker(storage, segment: MappedKvSegment, runs: list[tuple[int, int, int]]) -> list[int]:
    """The copy in one kv-export worker (one thread: the cores are shared with the engines, and a copy
    split by layer over two threads lost on a 2-vCPU guest: unpinned, both ran on one vCPU; pinned one
    per vCPU, it lost whenever another process ran on the second; docs/perf.md). Once cancelled,
    waits for it to stop."""
    stop = threading.Event()
    job = pool("kv-export", KV_TRANSFER_WORKERS).submit(copy_in_place, storage.k, storage.v, segment.k, segment.v,
                                                          runs, stop)
    try:
        return await asyncio.wrap_future(job)
    except BaseException:
        stop.set()
        concurrent.futures.wait([job])  # brief: the copy stops at its next layer
        raise
    finally:
        job = segment = None  # nothing keeps the mapping alive in a traceback (see shm_mapped_pools)


async def write_in_place(segment: MappedKvSegment, reservation: ShmReservation, source: OutgoingKv,
                         faults: FaultConfig, lease: contextlib.AbstractAsyncContextManager | None = None,
                         marks: list[tuple[str, float]] | None = None) -> ShmWritten:
    """Copy the request's KV into the target's reserved slots, holding the import's write lease:
    `lease` (MappedPools.lease: over the mapping's watch connection, where the target offers it) or
    a connection of its own. The lease ends only after the copy has stopped (also when this call
    is cancelled); the caller holds the mapping (MappedPools.using) for the whole call. `marks`: where
    the moments the lease was held, the copy ended and the lease ended are appended (timelines)."""
    marks = [] if marks is None else marks
    storage = source.storage
    runs = runs_into(source.slot_ids, reservation.slot_runs)
    if lease is None:
        lease = held_lease(reservation.socket_name, reservation.import_token)
    try:
        async with lease:
            marks.append(("lease_held", time.perf_counter()))
            if transfer_bytes(storage, len(source.slot_ids)) <= INLINE_MAX_BYTES:
                layer_crc32s = copy_in_place(storage.k, storage.v, segment.k, segment.v, runs)
            else:
                layer_crc32s = await _copy_in_worker(storage, segment, runs)
            if faults.any:
                layer_crc32s = _inject_fault(faults, segment, runs[0][1], layer_crc32s)
                if faults.kv_cut_after_layers is not None:
                    raise Unavailable(f"fault injected: shared-memory KV transfer cut after "
                                      f"{faults.kv_cut_after_layers} layers")
                if faults.kv_shm_hold_ms:
                    await asyncio.sleep(faults.kv_shm_hold_ms / 1e3)  # the window the kill tests aim at
            marks.append(("copied", time.perf_counter()))
        marks.append(("lease_ended", time.perf_counter()))
    finally:
        segment = None  # no reference to the mapping kept alive by a traceback (see shm_mapped_pools)
    return ShmWritten(tuple(layer_crc32s))
