"""Records of the control streams over a watch connection (dualpace.engine.transfer.shm_control), and what
the owner does with a record it does not know."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest

from dualpace.engine.transfer import shm_control
from dualpace.engine.transfer.same_host import KIND_FD, TicketServer, boot_id
from dualpace.engine.transfer.shm_control import BadRecord, ended_record, message_record, reply_record, split_record

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux")

SID = bytes(range(16))
FIXED = {b"L": 17, b"E": 17, b"X": 17}


def test_records_split_whole_and_wait_for_the_rest():
    data = message_record(SID, b"hello") + b"X" + SID
    for cut in range(len(data)):  # any prefix short of the first record: more bytes needed
        if cut < len(message_record(SID, b"hello")):
            assert split_record(data[:cut], 1, FIXED) == (None, 0)
    (kind, sid, code, body), size = split_record(data, 1, FIXED)
    assert (kind, sid, code, body) == (b"M", SID, 0, b"hello")
    assert split_record(data[size:], 1, FIXED)[0] == (b"X", SID, 0, b"")
    reply = reply_record(SID, b"r") + ended_record(SID, 14, "gone")
    (kind, _, _, body), size = split_record(reply, 2, {b"OK": 18, b"NO": 18})
    assert (kind, body) == (b"CM", b"r")
    assert split_record(reply[size:], 2, {})[0] == (b"CX", SID, 14, b"gone")


def test_unknown_or_oversized_records_are_refused():
    with pytest.raises(BadRecord):
        split_record(b"Z" + SID, 1, FIXED)
    with pytest.raises(BadRecord):
        split_record(b"M" + SID + struct.pack("<I", shm_control.MAX_RECORD_BYTES + 1), 1, FIXED)


async def test_the_owner_ends_a_watch_that_sends_another_protocol():
    server = TicketServer("test")
    server.stream_handler = lambda stream: asyncio.sleep(0)
    await server.start()
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    ticket = server.share_fd(fd)
    try:
        reader, writer = await asyncio.open_unix_connection("\0" + server.name)
        writer.write(KIND_FD + ticket)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"OK"
        writer.write(b"Z" + SID)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the owner closed the connection
        writer.close()
    finally:
        await server.close()
        os.close(fd)
