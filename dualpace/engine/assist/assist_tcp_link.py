"""Dense Assist's per-layer messages over a TCP data socket (between hosts; blocking, one thread).

The same-host rings (dualpace.engine.assist.shm_ring) need shared memory; across hosts this link
carries the same messages as the rings (a
SlotMessage: kind, iteration, layer, up to four tensors, a payload) as length-prefixed frames on
one TCP connection to the server's data socket (dualpace.engine.transfer.kv_tcp_import.TcpDataServer: the
client presents a one-time ticket from the gRPC answer), so cpu_service/assist_shm.py and
gpu_service/assist_shm_session.py run their session logic unchanged over either: TcpLink stands in
for the ShmSegment, TcpEndpoint for the ShmEndpoint.

A frame is laid out as a slot: a 256-byte head (the frame's size, the slot header, the tensor
table), the tensors at 64-byte aligned offsets, the payload. The receiver reads a frame into one of
two preallocated buffers (recv_into; messages alternate, so the previous one's views stay valid
while the next is read) and hands out cached views of it. Any socket failure, an EOF or a malformed
frame raises TcpLinkError (a ShmProtocolError), which ends the session as a failed ring does.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence

import torch

from dualpace.engine.assist.shm_ring import (
    _DTYPE_CODES,
    _SLOT_HEADER,
    _TENSOR_ENTRY,
    MAX_DIMS,
    MAX_TENSORS,
    SLOT_HEADER_BYTES,
    ShmProtocolError,
    SlotMessage,
    SlotSender,
    table_views,
    _aligned,
    _never,
    message_bytes,
)

_FRAME = struct.Struct("=Q")  # the frame's bytes, head included
_HEADER_AT = _FRAME.size
_TABLE_AT = _HEADER_AT + _SLOT_HEADER.size
HEAD_BYTES = SLOT_HEADER_BYTES  # the head: a frame's tensors start where a slot's do
assert _TABLE_AT + MAX_TENSORS * _TENSOR_ENTRY.size <= HEAD_BYTES
CONNECT_WAIT_S = 10.0  # the server waits this long for the client's connection after answering
_ZEROS = bytes(64)
# a receive without a deadline (a server between iterations) still has a timeout: the socket stays in
# timeout mode (switching to blocking and back costs an fcntl per call); stop() wakes it anyway
_IDLE_WAIT_S = 24 * 3600.0
STATUS_GRACE_S = 1.0


class TcpLinkError(ShmProtocolError):
    """The data socket failed, closed, or carried a malformed frame."""


class _Wakeup:
    """The endpoint's `incoming`, as a ring's doorbell is: interrupt() wakes a blocked receive."""

    def __init__(self, link: TcpLink):
        self._link = link
        self.num_sleeps = 0

    def interrupt(self) -> None:
        self._link.interrupt()


class TcpLink:
    """One assist stream's data connection (stands in for the ShmSegment). The client makes it with a
    connected socket; the server with the ticket's pending connection, taken on first use."""

    def __init__(self, slot_bytes: int, connection: socket.socket | None = None,
                 pending: asyncio.Future | None = None, loop: asyncio.AbstractEventLoop | None = None,
                 revoke=None):
        self.slot_bytes = slot_bytes
        self._connection = connection
        self._pending, self._loop, self._revoke = pending, loop, revoke
        self._lock = threading.Lock()
        self._interrupted = False
        self._closed = False

    def endpoint(self, outgoing: str, spin_s: float = 0.0) -> TcpEndpoint:
        return TcpEndpoint(self)

    def connection(self) -> socket.socket:
        """The connected socket (the server waits for the client's, up to CONNECT_WAIT_S)."""
        if self._connection is None:
            self._connection = self._await_connection()
        return self._connection

    def _await_connection(self) -> socket.socket:
        waiting = asyncio.run_coroutine_threadsafe(_wait(self._pending), self._loop)
        deadline_s = time.monotonic() + CONNECT_WAIT_S
        while True:
            if self._interrupted:
                waiting.cancel()
                raise TcpLinkError("data socket: stopped before the client connected")
            try:
                connection = waiting.result(timeout=0.05)
                break
            except TimeoutError:
                if time.monotonic() > deadline_s:
                    waiting.cancel()
                    raise TcpLinkError("data socket: the client did not connect") from None
            except BaseException as exc:
                raise TcpLinkError(f"data socket: no connection ({exc!r})") from None
        with self._lock:
            if self._interrupted or self._closed:
                connection.close()
                raise TcpLinkError("data socket: stopped")
        return connection

    def interrupt(self) -> None:
        """From another thread: wake a blocked receive (it then sees its stop, or an EOF)."""
        with self._lock:
            self._interrupted = True
            if self._connection is not None and not self._closed:
                try:
                    self._connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._connection is not None:
                self._connection.close()
        if self._revoke is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._revoke)
            except RuntimeError:
                pass  # the event loop is gone

    def close_fd(self) -> None:
        pass


async def _wait(pending: asyncio.Future) -> socket.socket:
    return await asyncio.shield(pending)


class TcpEndpoint(SlotSender):
    """send_parts / receive as ShmEndpoint's, over the link's socket (one thread at a time)."""

    def __init__(self, link: TcpLink):
        self._link = link
        self.slot_bytes = link.slot_bytes
        self.incoming = _Wakeup(link)
        self._buffers = [torch.empty(link.slot_bytes, dtype=torch.uint8) for _ in range(2)]
        self._views = [memoryview(buffer.numpy()) for buffer in self._buffers]
        self._send_layouts: dict[tuple, tuple] = {}
        self._receive_layouts: dict[tuple, tuple] = {}
        self.num_sent = 0
        self.num_received = 0

    def send_parts(self, kind: int, iteration_id: int, layer: int, tensors: Sequence[torch.Tensor],
                   payload: bytes = b"") -> None:
        tensors = [t if t.is_cpu and t.is_contiguous() else t.contiguous().cpu() for t in tensors]
        key = (len(payload), *[t.shape for t in tensors], *[t.dtype for t in tensors])
        layout = self._send_layouts.get(key)
        if layout is None:
            if len(self._send_layouts) >= 64:
                self._send_layouts.clear()
            layout = self._send_layouts[key] = self._send_layout(tensors, len(payload))
        head, pads = layout
        _SLOT_HEADER.pack_into(head, _HEADER_AT, kind, layer, iteration_id, len(tensors), len(payload))
        buffers = [head]
        for tensor, pad in zip(tensors, pads):
            buffers.append((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr()))
            if pad:
                buffers.append(_ZEROS[:pad])
        if payload:
            buffers.append(payload)
        try:
            _send_all(self._link.connection(), buffers)
        except OSError as exc:
            raise TcpLinkError(f"data socket: send failed: {exc}") from None
        self.num_sent += 1

    def _send_layout(self, tensors: list[torch.Tensor], payload_bytes: int) -> tuple[bytearray, list[int]]:
        sizes = [t.numel() * t.element_size() for t in tensors]
        if not self.fits(sizes, payload_bytes):
            raise ValueError(f"a message of {message_bytes(sizes, payload_bytes)} bytes does not fit a "
                             f"{self.slot_bytes}-byte frame")
        head = bytearray(HEAD_BYTES)
        offset, pads, at = HEAD_BYTES, [], _TABLE_AT
        for tensor, num_bytes in zip(tensors, sizes):
            if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPE_CODES:
                raise ValueError(f"a frame holds tensors of <= {MAX_DIMS} dims in {sorted(map(str, _DTYPE_CODES))}")
            dims = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
            _TENSOR_ENTRY.pack_into(head, at, _DTYPE_CODES[tensor.dtype], tensor.dim(), *dims, 0, offset)
            at += _TENSOR_ENTRY.size
            pads.append(_aligned(num_bytes) - num_bytes)
            offset += _aligned(num_bytes)
        _FRAME.pack_into(head, 0, offset + payload_bytes)
        return head, pads

    def receive(self, deadline_s: float | None, should_stop=_never) -> SlotMessage | None:
        """The next frame; None when should_stop() or the deadline (monotonic) comes first."""
        if should_stop():
            return None
        index = self.num_received % 2
        buffer, view = self._buffers[index], self._views[index]
        head_bytes = HEAD_BYTES
        try:
            connection = self._link.connection()
            connection.settimeout(_IDLE_WAIT_S if deadline_s is None else max(deadline_s - time.monotonic(), 1e-6))
            if not _receive_into(connection, view, 0, head_bytes):
                return _closed(should_stop)
            (frame_bytes,) = _FRAME.unpack_from(view, 0)
            if frame_bytes < head_bytes or frame_bytes > len(view):
                raise TcpLinkError(f"frame: {frame_bytes} bytes (a frame here holds {head_bytes}..{len(view)})")
            if frame_bytes > head_bytes and not _receive_into(connection, view, head_bytes, frame_bytes):
                return _closed(should_stop)
        except TimeoutError:
            if deadline_s is None:
                raise TcpLinkError("data socket: no frame within the idle wait")
            return None
        except OSError as exc:
            if should_stop():
                return None
            raise TcpLinkError(f"data socket: receive failed: {exc}") from None
        kind, layer, iteration_id, num_tensors, payload_bytes = _SLOT_HEADER.unpack_from(view, _HEADER_AT)
        if num_tensors > MAX_TENSORS:
            raise TcpLinkError(f"frame.num_tensors: {num_tensors} > {MAX_TENSORS}")
        table = bytes(view[_TABLE_AT:_TABLE_AT + num_tensors * _TENSOR_ENTRY.size])
        layout = self._receive_layouts.get((index, table))
        if layout is None:
            if len(self._receive_layouts) >= 64:
                self._receive_layouts.clear()
            layout = self._receive_layouts[(index, table)] = self._receive_layout(buffer, table)
        tensors, end = layout
        if end + payload_bytes != frame_bytes:
            raise TcpLinkError(f"frame.payload_bytes: {payload_bytes} bytes do not end the {frame_bytes}-byte frame")
        payload = bytes(view[end:frame_bytes]) if payload_bytes else b""
        self.num_received += 1
        return SlotMessage(kind, iteration_id, layer, tensors, payload)

    @staticmethod
    def _receive_layout(buffer: torch.Tensor, table: bytes) -> tuple[tuple[torch.Tensor, ...], int]:
        return table_views(buffer, table, "frame")

    def release(self) -> None:
        self._send_layouts.clear()
        self._receive_layouts.clear()


def _closed(should_stop) -> None:
    """At an EOF: None when the stop comes within STATUS_GRACE_S (the peer closes its socket as its
    session ends, a moment before the gRPC stream brings why: the caller reads that), else raise."""
    deadline_s = time.monotonic() + STATUS_GRACE_S
    while not should_stop():
        if time.monotonic() > deadline_s:
            raise TcpLinkError("data socket: the peer closed the connection")
        time.sleep(0.001)
    return None


def _receive_into(connection: socket.socket, view: memoryview, start: int, end: int) -> bool:
    """Fill view[start:end]; False at an EOF."""
    while start < end:
        got = connection.recv_into(view[start:end])
        if not got:
            return False
        start += got
    return True


def _send_all(connection: socket.socket, buffers: list) -> None:
    if isinstance(connection, ssl.SSLSocket):  # no sendmsg over TLS
        connection.sendall(b"".join(bytes(b) for b in buffers))
        return
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = connection.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def slot_bytes_of_offer(size_bytes: int, num_slots: int = 2) -> int:
    """The frame size both sides use: the slot size of the offered segment (the client sends its
    size even where no segment can be mapped), bounded."""
    from dualpace.engine.assist.shm_ring import HEADER_BYTES

    return max(0, min((size_bytes - HEADER_BYTES) // (2 * num_slots), MAX_FRAME_BYTES)) // 64 * 64


MAX_FRAME_BYTES = 64 * 2**20
