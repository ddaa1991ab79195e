"""The sender's half of a same-host KV transfer: check the target's mapped pool, copy under a lease.

The mapping itself comes from MappedPools (dualpace.engine.transfer.shm_mapped_pools): one per target
pool per process, held by each copy for as long as it runs.

Where the target takes progress reports (ShmReservation.takes_progress), PROGRESS_GROUPS is set and
the transfer is large enough for the workers, the layers are copied in PROGRESS_GROUPS consecutive ranges, and each range
is reported (ShmWritten.progress, with its checksums) as soon as its copy returned: the target
verifies it while the workers copy the next ones. A range is reported only after the C call that
wrote it returned in its worker (its streamed stores fenced), and is never written again: the
faults that stand for a byte changed in transit are injected inside the range's job, before its
report, as a real fault in the copy would be.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable

from dualpace.engine.transfer.kv_shm_protocol import ShmReservation, ShmWritten
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvLayout
from dualpace.engine.transfer.same_host import held_lease
from dualpace.engine.transfer.shm_kv_copy import INLINE_MAX_BYTES, copy_in_place, layer_ranges, transfer_bytes
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
    if len(reservation.slot_ids) != num_tokens or any(not 0 <= s < num_slots for s in reservation.slot_ids):
        raise InvalidArgument("shm_reserved.slot_ids", f"expected {num_tokens} slots below {num_slots}")


# Layer ranges reported one by one to a target that takes progress (0: no reports, the whole copy
# verified after it, as before). Each report is one record to the target and one wake-up of its loop;
# the last range is verified after the copy. Off by default: on a two-core host the overlap puts the
# target's verify threads beside the sender's copy threads and the 1024-token transfer got slower in
# every setting tried (docs/perf.md, session 11: 13.3-13.8 ms without, 14.2-20.6 ms with, interleaved).
# `DUALPACE_KV_PROGRESS_GROUPS=6` turns it on where cores are to spare (bench.kv_shm_progress_ab).
PROGRESS_GROUPS = int(os.environ.get("DUALPACE_KV_PROGRESS_GROUPS", 0))
# The sender's copy threads while it reports: with one, the target's verify of the reported ranges has
# the other core of a two-core host, instead of four threads sharing two (`DUALPACE_KV_PROGRESS_WORKERS`).
PROGRESS_WORKERS = int(os.environ.get("DUALPACE_KV_PROGRESS_WORKERS", KV_TRANSFER_WORKERS))


def _inject_fault(faults: FaultConfig, segment: MappedKvSegment, dst_slot_ids: list[int],
                  layers: range | None = None) -> None:
    """Test-only faults of dualpace.faults, with "chunk N" read as "layer N" on this path; only
    those in `layers` (default: all)."""
    flat = segment.k.view(segment.geometry.num_layers, -1, segment.geometry.num_kv_heads, segment.geometry.head_dim)
    layers = range(segment.geometry.num_layers) if layers is None else layers
    if faults.kv_corrupt_chunk in layers:
        flat[faults.kv_corrupt_chunk, dst_slot_ids[0]].view(-1)[0] += 1  # one value changed in transit
    if faults.kv_drop_chunk in layers:
        flat[faults.kv_drop_chunk, dst_slot_ids[0]].fill_(-1.0)  # the layer's first token never arrived


def _copy_range(storage, src_slot_ids: list[int], segment: MappedKvSegment, dst_slot_ids: list[int],
                stop: threading.Event, layers: range | None, faults: FaultConfig | None) -> tuple[int, list[int]]:
    """One job: its copy (and, in tests, its faults, where given), all done before it returns; its
    first layer and checksums."""
    crcs = copy_in_place(storage.k, storage.v, src_slot_ids, segment.k, segment.v, dst_slot_ids, stop, layers)
    if faults is not None and faults.any:
        _inject_fault(faults, segment, dst_slot_ids, layers)
    return (layers.start if layers is not None else 0), crcs


async def _copy_in_workers(storage, src_slot_ids: list[int], segment: MappedKvSegment, dst_slot_ids: list[int],
                           stop: threading.Event, faults: FaultConfig | None = None,
                           report: Callable[[ShmWritten], Awaitable[None]] | None = None,
                           safe_point: Callable[[], None] = lambda: None) -> list[int]:
    """The copy in the kv-export workers: a host pool's layers split between them (numpy's copy and
    the CRC drop the GIL), a device pool in one job. With `report`: in PROGRESS_GROUPS ranges of
    layers (`faults` injected in each range's job), each reported once its job returned (in the order
    they finish), after a safe point (a move abandoned by its caller ends there, as the gRPC path
    does before each chunk). Once cancelled or failed, waits for the jobs to stop."""
    if report is not None:
        parts = layer_ranges(storage.num_layers, PROGRESS_GROUPS)
    elif storage.k.device.type == "cpu":
        parts = layer_ranges(storage.num_layers, KV_TRANSFER_WORKERS)
    else:
        parts = [None]
    if report is not None and PROGRESS_WORKERS != KV_TRANSFER_WORKERS:
        executor = pool(f"kv-export-{PROGRESS_WORKERS}", PROGRESS_WORKERS)
    else:
        executor = pool("kv-export", KV_TRANSFER_WORKERS)
    jobs = [executor.submit(_copy_range, storage, src_slot_ids, segment, dst_slot_ids, stop, layers,
                            faults if report is not None else None) for layers in parts]
    checksums = [0] * storage.num_layers
    try:
        for finished in asyncio.as_completed([asyncio.wrap_future(job) for job in jobs]):
            first_layer, crcs = await finished
            checksums[first_layer:first_layer + len(crcs)] = crcs
            if report is not None:
                safe_point()
                await report(ShmWritten(tuple(crcs), progress=True, first_layer=first_layer))
    except BaseException:
        stop.set()
        concurrent.futures.wait(jobs)  # brief: each copy stops at its next layer
        raise
    finally:
        jobs = segment = None  # nothing keeps the mapping alive in a traceback (see shm_mapped_pools)
    return checksums


async def write_in_place(segment: MappedKvSegment, reservation: ShmReservation, source: OutgoingKv,
                         faults: FaultConfig, lease: contextlib.AbstractAsyncContextManager | None = None,
                         marks: list[tuple[str, float]] | None = None,
                         report: Callable[[ShmWritten], Awaitable[None]] | None = None) -> ShmWritten:
    """Copy the request's KV into the target's reserved slots, holding the import's write lease:
    `lease` (MappedPools.lease: over the mapping's watch connection, where the target offers it) or
    a connection of its own. The lease ends only after the copy has stopped (also when this call
    is cancelled); the caller holds the mapping (MappedPools.using) for the whole call. `marks`: where
    the moments the lease was held, the copy ended and the lease ended are appended (timelines). `report`:
    sends a progress report to the target (where it takes them; see PROGRESS_GROUPS)."""
    marks = [] if marks is None else marks
    storage = source.storage
    dst_slot_ids = list(reservation.slot_ids)
    stop = threading.Event()
    if lease is None:
        lease = held_lease(reservation.socket_name, reservation.import_token)
    try:
        async with lease:
            marks.append(("lease_held", time.perf_counter()))
            reporting = (report is not None and PROGRESS_GROUPS > 0 and storage.k.device.type == "cpu"
                         and transfer_bytes(storage, len(dst_slot_ids)) > INLINE_MAX_BYTES)
            if reporting:  # its faults are injected range by range, before each report
                layer_crc32s = await _copy_in_workers(storage, source.slot_ids, segment, dst_slot_ids, stop, faults,
                                                      report, source.safe_point)
            elif transfer_bytes(storage, len(dst_slot_ids)) <= INLINE_MAX_BYTES:
                layer_crc32s = copy_in_place(storage.k, storage.v, source.slot_ids, segment.k, segment.v,
                                             dst_slot_ids)
            else:
                layer_crc32s = await _copy_in_workers(storage, source.slot_ids, segment, dst_slot_ids, stop)
            if faults.any:
                if not reporting:
                    _inject_fault(faults, segment, dst_slot_ids)
                if faults.kv_cut_after is not None:
                    raise Unavailable(f"fault injected: shared-memory KV transfer cut after "
                                      f"{faults.kv_cut_after} layers")
                if faults.kv_shm_hold_ms:
                    await asyncio.sleep(faults.kv_shm_hold_ms / 1e3)  # the window the kill tests aim at
            marks.append(("copied", time.perf_counter()))
        marks.append(("lease_ended", time.perf_counter()))
    finally:
        segment = None  # no reference to the mapping kept alive by a traceback (see shm_mapped_pools)
    return ShmWritten(tuple(layer_crc32s))
