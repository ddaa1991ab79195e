"""Control streams over the watch connection: an import's messages on one host without gRPC.

Once a sender has mapped a target's pool, it holds a watch connection to the target's
TicketServer (dualpace.engine.transfer.same_host), proven same-host and same-user, opened with a ticket
the target gave it over the authenticated control plane. Where the target says so
(`ShmReservation.control_on_watch`), the sender's later transfers to that target run their
whole import stream over that connection instead of a new gRPC stream: the same messages
(serialized ImportKvMessage / ImportKvReply, the same servicer code), framed as records
beside the leases. Four gRPC messages of 0.6-1.0 ms each become Unix-socket records of a few
tens of microseconds.

Records (sender -> target, beside `L`/`E` + ticket):
    `M` + stream id (16) + u32 length + message     one import message, in order
    `X` + stream id (16)                            the sender abandoned the stream (cancel)
Records (target -> sender, beside the lease verdicts `OK`/`NO` + ticket):
    `CM` + stream id (16) + u32 length + reply      one reply
    `CX` + stream id (16) + u32 code + u32 length + details   the stream ended (code 0: after its
                                                    last reply, else a gRPC status code value)

The two-phase rules do not change: the target's servicer runs the import exactly as over gRPC.
A stream abandoned by the sender (`X`) or a connection that ends (either side died) cancels the
target's import, which frees its blocks only once the write lease has ended (its end comes
with the connection's); the sender sees the connection's end as the stream ending with
UNAVAILABLE before `committed`, and resumes the request. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

STREAM_ID_BYTES = 16
KIND_MESSAGE = b"M"
KIND_ABANDON = b"X"
REPLY = b"CM"
ENDED = b"CX"
MAX_RECORD_BYTES = 256 * 2**20  # a longer record ends the connection (a chunk of the fallback fits)
_LENGTH = struct.Struct("<I")
_CODE_LENGTH = struct.Struct("<II")
CODE_UNAVAILABLE = 14  # grpc.StatusCode.UNAVAILABLE's value (this module is grpc-free)

log = logging.getLogger(__name__)


class BadRecord(Exception):
    """Not this protocol: the connection is ended."""


def message_record(stream_id: bytes, payload: bytes) -> bytes:
    return KIND_MESSAGE + stream_id + _LENGTH.pack(len(payload)) + payload


def abandon_record(stream_id: bytes) -> bytes:
    return KIND_ABANDON + stream_id


def reply_record(stream_id: bytes, payload: bytes) -> bytes:
    return REPLY + stream_id + _LENGTH.pack(len(payload)) + payload


def ended_record(stream_id: bytes, code: int, details: str) -> bytes:
    text = details.encode("utf-8", "replace")[:4096]
    return ENDED + stream_id + _CODE_LENGTH.pack(code, len(text)) + text


def split_record(data: bytes, kind_bytes: int, fixed: dict[bytes, int]) -> tuple[tuple | None, int]:
    """The first complete record in `data`: ((kind, stream id or ticket, code, body), its length), or
    (None, 0) when more bytes are needed. `fixed`: kinds without a body and their total length.
    Raises BadRecord for an unknown kind or an oversized body."""
    if len(data) < kind_bytes:
        return None, 0
    kind = data[:kind_bytes]
    head = kind_bytes + STREAM_ID_BYTES
    if kind in fixed:
        size = fixed[kind]
        return ((kind, data[kind_bytes:size], 0, b""), size) if len(data) >= size else (None, 0)
    if kind in (KIND_MESSAGE, REPLY):
        if len(data) < head + _LENGTH.size:
            return None, 0
        (length,) = _LENGTH.unpack_from(data, head)
        code, start = 0, head + _LENGTH.size
    elif kind == ENDED:
        if len(data) < head + _CODE_LENGTH.size:
            return None, 0
        code, length = _CODE_LENGTH.unpack_from(data, head)
        start = head + _CODE_LENGTH.size
    else:
        raise BadRecord(f"unknown record {kind!r}")
    if length > MAX_RECORD_BYTES:
        raise BadRecord(f"record of {length} bytes")
    if len(data) < start + length:
        return None, 0
    return (kind, data[kind_bytes:head], code, data[start:start + length]), start + length


class WatchSender:
    """The owner's sends on one watch connection, in order (replies of several streams and lease
    verdicts never interleave). A record given to `send_soon` (the verdict of a lease asked for ahead,
    granted as its job opens) leaves with the next send (that job's reservation reply, right after
    it) or at the event loop's next turn: one wake-up of the sender for both, where a send of its own
    woke the sender a second time (0.07-0.14 ms before its lease was held, in a 16-token transfer)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connection):
        self._loop = loop
        self._connection = connection
        self._lock = asyncio.Lock()
        self._soon = b""
        self._flushes: set[asyncio.Task] = set()

    async def send(self, data: bytes) -> None:
        async with self._lock:
            data, self._soon = self._soon + data, b""
            await self._loop.sock_sendall(self._connection, data)

    def send_soon(self, record: bytes) -> None:
        if not self._soon:
            self._loop.call_soon(self._flush)
        self._soon += record

    def _flush(self) -> None:
        if self._soon:  # no send took it along
            task = self._loop.create_task(self.send(b""))
            self._flushes.add(task)
            task.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task) -> None:
        self._flushes.discard(task)
        if not task.cancelled() and task.exception() is not None:  # broken: its end ends the leases
            log.debug("a lease verdict was not sent: %s", task.exception())


class IncomingStream:
    """The target's end of one control stream: the sender's messages in order, replies sent back."""

    def __init__(self, stream_id: bytes, send: Callable[[bytes], Awaitable[None]]):
        self.stream_id = stream_id
        self._send = send
        self._messages: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.ended = False

    def deliver(self, payload: bytes) -> None:
        self._messages.put_nowait(payload)

    async def messages(self) -> AsyncIterator[bytes]:
        while (payload := await self._messages.get()) is not None:
            yield payload

    async def reply(self, payload: bytes) -> None:
        if self.ended:
            raise ConnectionError("the control stream ended")
        await self._send(reply_record(self.stream_id, payload))

    async def end(self, code: int, details: str = "") -> None:
        if not self.ended:
            self.ended = True
            await self._send(ended_record(self.stream_id, code, details))


class OutgoingStream:
    """The sender's end of one control stream (gRPC-free: bytes in, bytes out)."""

    def __init__(self, stream_id: bytes, send: Callable[[bytes], None], forget: Callable[[bytes], None]):
        self.stream_id = stream_id
        self._send = send  # ordered, never blocking (WatchLeases._send)
        self._forget = forget
        self._replies: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.code: int | None = None  # once ended: 0 after the last reply, else a gRPC status value
        self.details = ""
        self.on_end: Callable[[], None] | None = None  # called once, when the stream ends (either side)

    def write(self, payload: bytes, *more: bytes) -> None:
        """One message, or several in one send (the target reads them in order, woken once)."""
        if self.code is not None:
            raise ConnectionError("the control stream ended")
        self._send(b"".join(message_record(self.stream_id, p) for p in (payload, *more)))

    async def read(self) -> bytes | None:
        """The next reply; None once the stream ended (then `code` and `details` say how)."""
        if self.code is not None and self._replies.empty():
            return None
        return await self._replies.get()

    def abandon(self) -> None:
        """The sender stops (cancel, failure): the target drops the import, as on a cancelled RPC."""
        if self.code is None:
            self._ended(1, "abandoned by the sender")  # CANCELLED
            try:
                self._send(abandon_record(self.stream_id))
            except Exception:  # noqa: BLE001 - a broken connection: the owner sees its end instead
                pass

    def deliver(self, payload: bytes) -> None:
        if self.code is None:
            self._replies.put_nowait(payload)

    def _ended(self, code: int, details: str) -> None:
        if self.code is None:
            self.code, self.details = code, details
            self._forget(self.stream_id)
            self._replies.put_nowait(None)
            if self.on_end is not None:
                self.on_end()
