"""MappedPools: one mapping per target pool per process, however many transfers want it at once,
and a mapping that was dropped stays usable by the copies that hold it, then goes.

(The merged suite once saw the sending engine die without a traceback when several hand-offs
mapped one pool at once: each mapped it, the entries replaced each other and a replaced watch
socket was closed while the event loop still polled it. tests/reliability/test_kv_shm_concurrent.py
runs the same through real daemons on uvloop.)
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref

import pytest
import torch

from dualpace.engine.transfer.kv_shm_import import SharedKvPool
from dualpace.engine.transfer.kv_shm_protocol import ShmReservation
from dualpace.engine.transfer.same_host import boot_id, fetch_fd
from dualpace.engine.transfer.shm_mapped_pools import MappedPools
from dualpace.engine.transfer.shm_segment import SharedKvMemory

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux shared memory")

SHAPE = (2, 4, 4, 2, 8)  # layers, blocks, block size, kv heads, head dim
HANG_GUARD_S = 30.0


async def served_pool() -> tuple[SharedKvPool, ShmReservation, torch.Tensor]:
    """A pool served on this host, a reservation naming it, and the owner's K tensor."""
    memory = SharedKvMemory()
    owner_k, _ = memory.allocate(SHAPE, torch.float32)
    pool = await SharedKvPool.start(memory)
    return pool, ShmReservation(pool.server.name, pool.segment_ticket, b"\0" * 16, ()), owner_k


class CountingFetch:
    """fetch_fd, counted, held before the handshake until `release` is set (under a hang guard):
    the test decides what happens while a fetch is in flight."""

    def __init__(self):
        self.num_calls = 0
        self.num_done = 0
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, name: str, ticket: bytes):
        with self._lock:
            self.num_calls += 1
        assert self.release.wait(HANG_GUARD_S), "the test never released the fetch"
        fetched = fetch_fd(name, ticket)
        with self._lock:
            self.num_done += 1
        return fetched


def pool_descriptors() -> int:
    """Descriptors of this process open on a KV pool memfd (the owner's own included)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:dualpace-kv" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


async def wait_until(condition) -> bool:
    for _ in range(2000):
        if condition():
            return True
        await asyncio.sleep(0.005)
    return condition()


async def test_concurrent_transfers_map_a_pool_once():
    pool, reservation, owner_k = await served_pool()
    fetch = CountingFetch()
    mapped = MappedPools(fetch)
    entered = asyncio.Event()
    segments = []
    num_started = [0]

    async def transfer(index: int) -> None:
        num_started[0] += 1
        async with mapped.using(reservation) as segment:
            segments.append(segment)
            if len(segments) == 8:
                entered.set()
            await entered.wait()  # all eight hold it at once
            segment.k[0, index % 4].fill_(float(index % 4))

    transfers = asyncio.gather(*(transfer(i) for i in range(8)))
    # All eight wait for the mapping while the one fetch is in flight, then it completes.
    assert await wait_until(lambda: num_started[0] == 8 and fetch.num_calls == 1)
    fetch.release.set()
    await transfers
    assert fetch.num_calls == 1 and mapped.num_mapped == 1 and mapped.num_in_use == 0
    assert all(segment is segments[0] for segment in segments)
    assert [owner_k[0, i, 0, 0, 0].item() for i in range(4)] == [0.0, 1.0, 2.0, 3.0]  # the owner sees the writes
    async with mapped.using(reservation):
        pass
    assert fetch.num_calls == 1  # the next transfer reuses it
    mapped.close()
    await pool.close()


async def test_a_dropped_mapping_lives_until_its_last_copy_ends():
    pool, reservation, _ = await served_pool()
    mapped = MappedPools()
    async with mapped.using(reservation) as segment:
        buffer = weakref.ref(segment._buffer)
        await pool.close()  # the owner goes away: its end of the watch connection closes
        assert await wait_until(lambda: mapped.num_mapped == 0)
        assert mapped.num_in_use == 1
        segment.v[1, 3].fill_(7.0)  # still mapped for the copy that holds it
        assert segment.v[1, 3, 0, 0, 0].item() == 7.0
        del segment
    assert mapped.num_in_use == 0
    assert buffer() is None  # nothing here holds it any more: the kernel unmapped it
    mapped.close()


async def test_another_segment_under_the_same_name_replaces_the_mapping():
    """An owner that restarted under the same socket name serves another segment (another token):
    the old mapping is dropped, not reused, and its memory goes."""
    first, first_reservation, _ = await served_pool()
    second, second_reservation, owner_k = await served_pool()
    sockets = {first.segment_ticket: first.server.name, second.segment_ticket: second.server.name}
    mapped = MappedPools(lambda name, ticket: fetch_fd(sockets[ticket], ticket))
    async with mapped.using(first_reservation) as segment:
        old = weakref.ref(segment._buffer)
        del segment
    restarted = ShmReservation(first_reservation.socket_name, second_reservation.segment_token, b"\0" * 16, ())
    async with mapped.using(restarted) as segment:
        segment.k[1, 2].fill_(5.0)
        del segment
    assert owner_k[1, 2, 0, 0, 0].item() == 5.0  # the copy went into the new segment
    assert mapped.num_mapped == 1 and old() is None
    mapped.close()
    await first.close()
    await second.close()


async def test_a_transfer_cancelled_while_mapping_leaves_no_descriptor():
    pool, reservation, _ = await served_pool()
    fetch = CountingFetch()
    mapped = MappedPools(fetch)
    before = pool_descriptors()
    task = asyncio.create_task(mapped.using(reservation).__aenter__())
    assert await wait_until(lambda: fetch.num_calls == 1)  # inside the fd handshake, held there
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fetch.release.set()
    assert await wait_until(lambda: fetch.num_done == 1)  # the handshake's thread handed an fd over
    assert await wait_until(lambda: pool_descriptors() == before)
    assert mapped.num_mapped == 0 and mapped.num_in_use == 0
    await pool.close()
