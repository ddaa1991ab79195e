"""Blocks reserved ahead (dualpace.engine.transfer.shm_reserved_ahead): after a transfer over the
target's watch, the sender reserves the blocks of its next one there; that transfer copies at once
and sends its header with written + commit. The outputs stay greedy-identical, and no block stays
used once a reservation is given back by the sender, ended by the target, or outgrown; a
transfer whose reservation the target ended makes a fresh import; a refused transfer into reserved
blocks leaves the request on its source and frees them.
"""

from __future__ import annotations

import os
import socket

import pytest

from dualpace.engine.transfer import kv_shm_import, shm_reserved_ahead
from dualpace.engine.transfer.migration import RESERVED_AHEAD_PREFIX
from dualpace.engine.transfer.same_host import boot_id
from dualpace.serve import kv_shm_transport
from dualpace.serve.kv_shm_transport import SameHostKvSender
from tests.helpers import until
from tests.serve.test_kv_shm_control import (
    HANG_GUARD_S,
    corrupt_transfer_refused,
    finishes_on_source,
    first_transfer,
    migrated,
    sender_watch,
)
from tests.serve.test_kv_shm_import_stream import Served, expected

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux shared memory")


def reserved_at_target(served: Served):
    """The target's imports reserved ahead: the scheduler ids of their blocks."""
    return [i for i in served.target[0].core.scheduler._importing if i.startswith(RESERVED_AHEAD_PREFIX)]


async def reservation_made(served: Served) -> shm_reserved_ahead.ReservedAhead:
    await until(lambda: served.mapped.ahead._held, "a reservation ahead", HANG_GUARD_S)
    (held,) = served.mapped.ahead._held.values()
    return held


async def all_blocks_free(served: Served) -> None:
    """Every block free on both sides, those reserved ahead too (the load does not count them)."""
    pool = served.target[0].core.scheduler.blocks
    await until(lambda: pool.num_used_blocks == 0, "the target's blocks freed", HANG_GUARD_S)
    assert served.source[0].load().kv_blocks_used == 0 and not reserved_at_target(served)


async def test_the_next_transfer_takes_the_blocks_reserved_ahead(tiny):
    served = await Served().start(tiny)
    await first_transfer(served, tiny)  # over gRPC: maps the pool, then reserves ahead over its watch
    held = await reservation_made(served)
    (reserved_id,) = reserved_at_target(served)
    assert served.target[0].core.scheduler.blocks.num_tokens(reserved_id) == held.num_tokens
    assert served.target[0].load().kv_blocks_used == 0  # reserved ahead: not counted as used
    for request_id in ("w1", "w2"):
        sender, tokens = await migrated(served, request_id)
        assert sender.used_reserved_ahead and sender.used_shm and tokens == expected(tiny)
        assert reserved_id not in served.target[0].core.scheduler._importing  # adopted, the rest freed
        await reservation_made(served)  # and the next one reserved
        (reserved_id,) = reserved_at_target(served)
    served.mapped.ahead.close()  # given back: the target frees its blocks once the lease has ended
    await all_blocks_free(served)
    await served.close()


async def test_a_reservation_no_transfer_takes_is_given_back(tiny, monkeypatch):
    monkeypatch.setattr(shm_reserved_ahead, "RESERVE_AHEAD_MAX_AGE_S", 0.05)
    monkeypatch.setattr(kv_shm_import, "RESERVED_AHEAD_MAX_WAIT_S", 3600.0)  # the sender's doing, not the target's
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    await until(lambda: reserved_at_target(served), "a reservation ahead at the target", HANG_GUARD_S)
    await until(lambda: not served.mapped.ahead._held, "the reservation given back", HANG_GUARD_S)
    await all_blocks_free(served)
    await served.close()


async def test_the_target_ends_a_reservation_whose_header_does_not_come(tiny, monkeypatch):
    monkeypatch.setattr(kv_shm_import, "RESERVED_AHEAD_MAX_WAIT_S", 0.05)
    monkeypatch.setattr(shm_reserved_ahead, "RESERVE_AHEAD_MAX_AGE_S", 3600.0)  # the target's doing
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    await until(lambda: reserved_at_target(served) or served.mapped.ahead._making, "reserving", HANG_GUARD_S)
    await until(lambda: not served.mapped.ahead._held and not served.mapped.ahead._making,
                "the sender told of its end", HANG_GUARD_S)
    await all_blocks_free(served)  # its lease ended by the sender, its blocks freed
    sender, tokens = await migrated(served, "w2")  # a fresh import, as before any reservation
    assert sender.used_shm and not sender.used_reserved_ahead and tokens == expected(tiny)
    await served.close()


async def test_a_reservation_ended_during_the_copy_gives_way_to_a_fresh_import(tiny, monkeypatch):
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    held = await reservation_made(served)
    write_in_place = SameHostKvSender._write_in_place

    async def copy_then_target_ends_it(self, call, answer, header, chunks):
        written = await write_in_place(self, call, answer, header, chunks)
        if call is held.call:  # the target ends the import reserved ahead, as its wait running out does:
            held.call.stream.write(b"")  # an empty message is no header, so the import ends there
            await until(lambda: not held.open, "the end of the reservation", HANG_GUARD_S)
        return written

    monkeypatch.setattr(SameHostKvSender, "_write_in_place", copy_then_target_ends_it)
    sender, tokens = await migrated(served, "w2")
    assert sender.used_shm and not sender.used_reserved_ahead and tokens == expected(tiny)
    served.mapped.ahead.close()
    await all_blocks_free(served)
    await served.close()


async def test_a_larger_transfer_reserves_anew_and_a_bad_header_frees_the_reservation(tiny, monkeypatch):
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    small = await reservation_made(served)
    small.num_tokens = 1  # as if reserved for a one-token transfer: w2's KV does not fit it
    sender, tokens = await migrated(served, "w2")
    assert not sender.used_reserved_ahead and tokens == expected(tiny)
    await until(lambda: served.mapped.ahead._held.get(sender.target_address) not in (None, small),
                "a larger reservation", HANG_GUARD_S)
    assert not small.open  # the small one given back
    # A written record the target refuses fails the transfer into reserved blocks, and frees them.
    sender, channel = await corrupt_transfer_refused(served)
    assert sender.used_reserved_ahead
    await finishes_on_source(served, channel, tiny)
    served.mapped.ahead.close()
    await all_blocks_free(served)
    await served.close()


async def test_the_watch_ending_during_a_copy_into_reserved_blocks_frees_them(tiny, monkeypatch):
    """The watch connection ends while the sender copies into blocks reserved ahead (as when the
    sender dies, or the target): the target drops that import once the lease has ended with the
    connection, and the transfer, whose header had not left, goes by a fresh import instead."""
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    held = await reservation_made(served)
    (reserved_id,) = reserved_at_target(served)
    write_in_place = kv_shm_transport.write_in_place

    async def connection_ends_while_copying(*args, **kwargs):
        written = await write_in_place(*args, **kwargs)
        if held.open:
            sender_watch(served).shutdown(socket.SHUT_RDWR)  # both ends see the connection end
            await until(lambda: not held.open, "the sender sees the connection's end", HANG_GUARD_S)
        return written

    monkeypatch.setattr(kv_shm_transport, "write_in_place", connection_ends_while_copying)
    sender, tokens = await migrated(served, "w1")
    assert sender.used_shm and not sender.used_reserved_ahead and tokens == expected(tiny)
    assert reserved_id not in reserved_at_target(served)
    served.mapped.ahead.close()
    await all_blocks_free(served)
    await served.close()
