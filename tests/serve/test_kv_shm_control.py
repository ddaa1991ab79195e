"""Same-host imports whose messages go over the pool's watch connection, not gRPC
(dualpace.engine.transfer.shm_control): after a first transfer has mapped the target's pool, the next
ones open no gRPC stream; the two-phase rules hold when either side's end of the connection
closes at each phase (the sender's death, the target's), and when the sender abandons the
stream (a cancelled MigrateOut): the request keeps running on the source, greedy-identical, and
no block stays used on either side.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from dualpace.engine.transfer.kv_shm_import import ShmImport
from dualpace.engine.transfer.migration import migrate_out
from dualpace.engine.transfer.same_host import boot_id
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.sampling import FinishReason
from dualpace.serve import kv_shm_transport
from dualpace.serve.kv_shm_transport import SameHostKvSender
from tests.engine.test_migration import wait_tokens
from tests.helpers import until
from tests.serve.test_kv_shm_import_stream import PARAMS, PROMPT, Served, expected, fresh_imports_only  # noqa: F401

HANG_GUARD_S = 30.0

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux shared memory")


async def migrated(served: Served, request_id: str, sender: SameHostKvSender | None = None):
    channel = await served.source[0].add_request(request_id, PROMPT, PARAMS)
    await wait_tokens(channel, 4)
    sender = sender or served.sender()
    await migrate_out(served.source[0], request_id, sender, migrated_to="dst")
    rest = [t async for update in served.target[0].channel(request_id).follow(len(channel.output_token_ids))
            for t in update.new_token_ids]
    return sender, channel.output_token_ids + rest


async def first_transfer(served: Served, tiny) -> None:
    """Over gRPC (nothing mapped yet): maps the pool and learns that the target takes control streams."""
    sender, tokens = await migrated(served, "first")
    assert sender.used_shm and not sender.used_watch_control and tokens == expected(tiny)


def sender_watch(served: Served) -> socket.socket:
    (mapped,) = served.mapped._pools.values()
    return mapped.watch


def close_target_side(served: Served) -> None:
    for task in list(served.same_host.pool.server._connections):
        task.cancel()  # the target's end of every watch connection closes (as when it dies)


async def test_later_transfers_open_no_grpc_stream(tiny, monkeypatch):
    served = await Served().start(tiny)
    await first_transfer(served, tiny)

    def no_grpc(self, channel):
        raise AssertionError("a gRPC import stream was opened to a target reachable over the watch")

    monkeypatch.setattr(SameHostKvSender, "_open_import", no_grpc)
    for request_id in ("w1", "w2"):
        sender, tokens = await migrated(served, request_id)
        assert sender.used_shm and sender.used_watch_control and tokens == expected(tiny)
    assert served.mapped.num_mapped == 1
    assert served.source[0].load().kv_blocks_used == 0 and served.target[0].load().kv_blocks_used == 0
    await served.close()


async def corrupt_transfer_refused(served: Served):
    """Request "c" migrated with a torn layer: the target refuses the written record (its status in
    the error). The sender and the request's channel on the source."""
    channel = await served.source[0].add_request("c", PROMPT, PARAMS)
    await wait_tokens(channel, 4)
    sender = served.sender(FaultConfig(kv_corrupt_layer=1))
    with pytest.raises(Unavailable, match="INVALID_ARGUMENT.*checksums for"):
        await migrate_out(served.source[0], "c", sender)
    return sender, channel


async def test_a_target_error_over_the_watch_is_its_status(tiny):
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    sender, channel = await corrupt_transfer_refused(served)
    assert sender.used_watch_control
    await finishes_on_source(served, channel, tiny)
    await served.close()


async def finishes_on_source(served: Served, channel, tiny) -> None:
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]
    assert tokens == expected(tiny)
    assert channel.finish_reason == FinishReason.LENGTH and channel.migrated_to is None
    # The target drops the import once the lease has ended (its cleanup task).
    await until(lambda: served.target[0].load().kv_blocks_used == 0, "the target's blocks freed", HANG_GUARD_S)
    assert not served.target[0].core.scheduler.requests
    assert served.source[0].load().kv_blocks_used == 0


@pytest.mark.parametrize("side", ["sender", "target"])
@pytest.mark.parametrize("phase", ["header", "copy", "written"])
async def test_the_connection_closing_at_each_phase_keeps_the_request_on_the_source(tiny, monkeypatch, side, phase):
    """The watch connection ends (either side's end closes, as when that daemon dies) after the header
    was sent, while the sender copies under its lease, or after shm_written (with commit) reached
    the target but before it verified it: the import is dropped, the source resumes."""
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    ending, problems = asyncio.Event(), []
    end_import = ShmImport.close

    async def watched_end_import(self):
        ending.set()
        await end_import(self)
    monkeypatch.setattr(ShmImport, "close", watched_end_import)

    def close() -> None:
        if side == "sender":
            sender_watch(served).shutdown(socket.SHUT_RDWR)  # both ends see the connection end
        else:
            close_target_side(served)

    async def until_the_target_ends_the_import() -> None:
        try:
            await asyncio.wait_for(ending.wait(), HANG_GUARD_S)
        except TimeoutError:
            problems.append("the target never ended the import")

    if phase == "header":
        expect_answer = SameHostKvSender._expect_answer

        async def closed_before_answer(self, call):
            close()
            return await expect_answer(self, call)
        monkeypatch.setattr(SameHostKvSender, "_expect_answer", closed_before_answer)
    elif phase == "copy":
        write_in_place = kv_shm_transport.write_in_place

        async def closed_while_copying(*args, **kwargs):
            written = await write_in_place(*args, **kwargs)
            close()
            await until_the_target_ends_the_import()  # still holding the lease: the target must wait for its end
            return written
        monkeypatch.setattr(kv_shm_transport, "write_in_place", closed_while_copying)
    else:
        verify = ShmImport.written

        async def closed_before_verified(self, written):
            close()
            try:  # the connection's end cancels this handler: the target drops the import
                await asyncio.wait_for(asyncio.Event().wait(), HANG_GUARD_S)
            except TimeoutError:
                problems.append("the connection's end never cancelled the import")
            return await verify(self, written)
        monkeypatch.setattr(ShmImport, "written", closed_before_verified)
    channel = await served.source[0].add_request("k", PROMPT, PARAMS)
    await wait_tokens(channel, 4)
    sender = served.sender()
    with pytest.raises(Unavailable):
        await migrate_out(served.source[0], "k", sender)
    assert sender.used_watch_control
    await finishes_on_source(served, channel, tiny)
    assert not problems, problems
    monkeypatch.undo()
    sender, tokens = await migrated(served, "after")  # over gRPC again: the mapping went with its watch
    assert sender.used_shm and not sender.used_watch_control and tokens == expected(tiny)
    await served.close()


class LeaseEndingOn:
    """A write lease whose end first sets `reached`, then waits for `proceed` (or the cancel)."""

    def __init__(self, lease, reached: asyncio.Event, proceed: asyncio.Event):
        self.lease, self.reached, self.proceed = lease, reached, proceed

    async def __aenter__(self):
        return await self.lease.__aenter__()

    async def __aexit__(self, *exc_info):
        self.reached.set()
        try:
            await self.proceed.wait()
        finally:
            await self.lease.__aexit__(*exc_info)


@pytest.mark.parametrize("phase", ["header", "copy"])
async def test_a_cancelled_sender_abandons_the_stream(tiny, monkeypatch, phase):
    """MigrateOut cancelled while its transfer waits for the reservation, or during the copy: the
    sender abandons the control stream (`X`), the target drops the import; the watch stays usable."""
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    reached, proceed = asyncio.Event(), asyncio.Event()
    if phase == "header":
        # The reservation is read only once the cancel has landed: with the lease asked for ahead,
        # nothing else is left to wait for before the copy, which could otherwise pass the last safe
        # point before the cancel reaches the move (then the move commits, as it must after it).
        expect_answer = SameHostKvSender._expect_answer

        async def held_answer(self, call):
            reached.set()
            await proceed.wait()
            return await expect_answer(self, call)
        monkeypatch.setattr(SameHostKvSender, "_expect_answer", held_answer)
        faults = FaultConfig()
    else:
        # The copy is done and the lease still held (its end waits for `proceed`) when the cancel lands.
        write_in_place = kv_shm_transport.write_in_place

        async def copying(segment, answer, chunks, faults, lease, marks):
            assert lease is not None, "the lease was expected on the watch"
            return await write_in_place(segment, answer, chunks, faults, LeaseEndingOn(lease, reached, proceed),
                                        marks)
        monkeypatch.setattr(kv_shm_transport, "write_in_place", copying)
        faults = FaultConfig()
    channel = await served.source[0].add_request("x", PROMPT, PARAMS)
    await wait_tokens(channel, 4)
    sender = served.sender(faults)
    task = asyncio.create_task(migrate_out(served.source[0], "x", sender))
    await asyncio.wait_for(reached.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    proceed.set()
    await finishes_on_source(served, channel, tiny)
    monkeypatch.undo()
    sender, tokens = await migrated(served, "after")
    assert sender.used_watch_control and tokens == expected(tiny)
    await served.close()


async def test_concurrent_transfers_share_the_watch(tiny):
    """Several streams at once over one watch connection: records of different streams interleave,
    each transfer gets its own replies (and the lease verdicts theirs)."""
    served = await Served().start(tiny)
    await first_transfer(served, tiny)
    channels = {}
    for i in range(3):
        channels[i] = await served.source[0].add_request(f"c{i}", PROMPT, PARAMS)
    for channel in channels.values():
        await wait_tokens(channel, 4)
    senders = [served.sender() for _ in channels]
    await asyncio.gather(*(migrate_out(served.source[0], f"c{i}", senders[i], migrated_to="dst") for i in channels))
    for i, channel in channels.items():
        assert senders[i].used_watch_control and channel.migrated_to == "dst"
        rest = [t async for update in served.target[0].channel(f"c{i}").follow(len(channel.output_token_ids))
                for t in update.new_token_ids]
        assert channel.output_token_ids + rest == expected(tiny)
    assert served.mapped.num_mapped == 1
    assert served.source[0].load().kv_blocks_used == 0 and served.target[0].load().kv_blocks_used == 0
    await served.close()
