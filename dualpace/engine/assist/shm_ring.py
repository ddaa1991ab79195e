"""A shared-memory segment for one Dense Assist session on one host: two rings of
fixed-size slots (down: gpu_service -> cpu_service, up: the other way), each with a doorbell.

    client (cpu_service)                          server (gpu_service)
    segment = ShmSegment.create(2, slot_bytes)
    offer: segment.peer_path, size, token   --gRPC-->  ShmSegment.open(path, size, token)
                                            <--gRPC--  answer: accepted, server token
    segment.verify_server_token(token); segment.close_fd()

The segment is a memfd: it has no name in any file system, so nothing is left behind when
either process dies, whatever the moment (the kernel frees it with the last mapping). The
server opens it through /proc/<client pid>/fd/<fd> (same user, same host, same /proc), which
doubles as the same-host proof: the random token the client wrote must be there, and the
token the server writes back must reach the client. Once accepted, the client closes its fd:
both sides hold only their mappings.

A slot holds one message: a small header (kind, iteration id, layer, up to four tensors'
dtype and shape, a payload length) and the tensors' bytes (64-byte aligned), then opaque
payload bytes. The producer writes slot `n % num_slots`, then posts n + 1 on the direction's
doorbell; received tensors are views into the slot, valid until that direction has carried
num_slots more messages (Dense Assist alternates down and up, so a view stays valid until
the reply after next). A malformed header raises ShmProtocolError naming the field.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualpace.engine.assist.shm_doorbell import Doorbell

MAGIC = b"DPASHM01"
VERSION = 1
TOKEN_BYTES = 16
HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 256
ALIGN_BYTES = 64
MAX_TENSORS = 4
MAX_DIMS = 3
DIRECTIONS = ("down", "up")
_LAYOUT = struct.Struct("=IIQ")  # version, num_slots, slot_bytes
_LAYOUT_AT, _CLIENT_TOKEN_AT, _SERVER_TOKEN_AT = 8, 32, 48
_DOORBELL_AT = {"down": 128, "up": 192}
_SLOT_HEADER = struct.Struct("=IIQII")  # kind, layer, iteration_id, num_tensors, payload_bytes
_TENSOR_ENTRY = struct.Struct("=II3IIQ")  # dtype code, ndim, dims[3], pad, offset in the slot
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int64: 4}
_MAX_CACHED_LAYOUTS = 64
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_memmove = ctypes.memmove


class ShmProtocolError(ValueError):
    """The peer wrote something the segment's format does not allow (the message names the field)."""


@dataclass(slots=True)
class SlotMessage:
    kind: int
    iteration_id: int = 0
    layer: int = 0
    tensors: Sequence[torch.Tensor] = ()  # received: the slot's cached views (a tuple; do not mutate)
    payload: bytes = b""


def _never() -> bool:
    return False


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def message_bytes(tensor_bytes: list[int], payload_bytes: int = 0) -> int:
    """The slot space a message with tensors of these sizes and that much payload needs."""
    return SLOT_HEADER_BYTES + sum(_aligned(n) for n in tensor_bytes) + payload_bytes


def segment_bytes(num_slots: int, slot_bytes: int) -> int:
    return HEADER_BYTES + 2 * num_slots * slot_bytes


class ShmSegment:
    """One mapped segment; create() on the client, open() on the server."""

    def __init__(self, mapping: mmap.mmap, fd: int | None, num_slots: int, slot_bytes: int):
        self.mapping = mapping
        self._fd = fd
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.size_bytes = segment_bytes(num_slots, slot_bytes)
        self.client_token = bytes(mapping[_CLIENT_TOKEN_AT:_CLIENT_TOKEN_AT + TOKEN_BYTES])
        self.peer_path = None if fd is None else f"/proc/{os.getpid()}/fd/{fd}"
        self._endpoints: list[ShmEndpoint] = []

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, name: str = "dualpace-assist") -> ShmSegment:
        if num_slots < 2 or slot_bytes < SLOT_HEADER_BYTES or slot_bytes % ALIGN_BYTES:
            raise ValueError(f"a ring needs >= 2 slots of >= {SLOT_HEADER_BYTES} bytes, a multiple of "
                             f"{ALIGN_BYTES} (got {num_slots} x {slot_bytes})")
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            size_bytes = segment_bytes(num_slots, slot_bytes)
            os.ftruncate(fd, size_bytes)
            mapping = mmap.mmap(fd, size_bytes)
        except BaseException:
            os.close(fd)
            raise
        mapping[0:len(MAGIC)] = MAGIC
        _LAYOUT.pack_into(mapping, _LAYOUT_AT, VERSION, num_slots, slot_bytes)
        mapping[_CLIENT_TOKEN_AT:_CLIENT_TOKEN_AT + TOKEN_BYTES] = os.urandom(TOKEN_BYTES)
        return cls(mapping, fd, num_slots, slot_bytes)

    @classmethod
    def open(cls, path: str, size_bytes: int, client_token: bytes) -> ShmSegment:
        """Map the client's segment and prove it is the one offered; OSError or ShmProtocolError if not."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size_bytes or size_bytes < HEADER_BYTES:
                raise ShmProtocolError(f"shm_offer.size_bytes: {size_bytes} is not the size of {path}")
            mapping = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)  # the mapping keeps the memory; no descriptor stays open here
        try:
            if bytes(mapping[0:len(MAGIC)]) != MAGIC:
                raise ShmProtocolError("shm_offer.path: not a Dense Assist segment")
            if bytes(mapping[_CLIENT_TOKEN_AT:_CLIENT_TOKEN_AT + TOKEN_BYTES]) != client_token:
                raise ShmProtocolError("shm_offer.token: the segment holds another token (not the same host?)")
            version, num_slots, slot_bytes = _LAYOUT.unpack_from(mapping, _LAYOUT_AT)
            if version != VERSION:
                raise ShmProtocolError(f"shm_offer: segment version {version}, this server speaks {VERSION}")
            if num_slots < 2 or slot_bytes < SLOT_HEADER_BYTES or segment_bytes(num_slots, slot_bytes) != size_bytes:
                raise ShmProtocolError(f"shm_offer: layout {num_slots} x {slot_bytes} does not fill {size_bytes} bytes")
        except BaseException:
            mapping.close()
            raise
        segment = cls(mapping, None, num_slots, slot_bytes)
        segment.server_token = os.urandom(TOKEN_BYTES)
        mapping[_SERVER_TOKEN_AT:_SERVER_TOKEN_AT + TOKEN_BYTES] = segment.server_token
        return segment

    def verify_server_token(self, token: bytes) -> bool:
        """Client: True when the server wrote this token into our segment (it maps the same memory)."""
        return len(token) == TOKEN_BYTES and bytes(self.mapping[_SERVER_TOKEN_AT:_SERVER_TOKEN_AT + TOKEN_BYTES]) == token

    def close_fd(self) -> None:
        """Client, once the server has mapped the segment: only the mappings keep it now."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.peer_path = None

    def endpoint(self, outgoing: str, spin_s: float) -> ShmEndpoint:
        """The side that sends on `outgoing` ("down" for the server, "up" for the client)."""
        incoming = DIRECTIONS[1 - DIRECTIONS.index(outgoing)]
        endpoint = ShmEndpoint(self, outgoing, incoming, spin_s)
        self._endpoints.append(endpoint)
        return endpoint

    def ring_offset(self, direction: str, index: int) -> int:
        return HEADER_BYTES + (DIRECTIONS.index(direction) * self.num_slots + index) * self.slot_bytes

    def close(self) -> None:
        """Unmap (idempotent). Views still held elsewhere keep the mapping until they are freed."""
        for endpoint in self._endpoints:
            endpoint.release()
        self._endpoints.clear()
        self.close_fd()
        try:
            self.mapping.close()
        except BufferError:
            pass  # a tensor view is still alive; the mapping goes with it


def table_views(slot: torch.Tensor, table: bytes, what: str = "slot") -> tuple[tuple[torch.Tensor, ...], int]:
    """The tensors a tensor table describes, as views of `slot` (uint8, a slot or a frame), checked
    (ShmProtocolError naming the entry); and where the payload starts."""
    tensors, end = [], SLOT_HEADER_BYTES
    for position in range(len(table) // _TENSOR_ENTRY.size):
        code, ndim, *dims, _, offset = _TENSOR_ENTRY.unpack_from(table, position * _TENSOR_ENTRY.size)
        dtype = _DTYPES.get(code)
        if dtype is None or ndim > MAX_DIMS:
            raise ShmProtocolError(f"{what}.tensors[{position}]: dtype code {code} or {ndim} dims is not allowed")
        shape = dims[:ndim]
        num_bytes = math.prod(shape) * dtype.itemsize
        if offset < end or offset % ALIGN_BYTES or offset + num_bytes > len(slot):
            raise ShmProtocolError(f"{what}.tensors[{position}]: {num_bytes} bytes at {offset} are outside the {what}")
        tensors.append(slot[offset:offset + num_bytes].view(dtype).view(shape))
        end = offset + _aligned(num_bytes)
    return tuple(tensors), end


class SlotSender:
    """fits() and send() over a send_parts() (ShmEndpoint; the TCP link's TcpEndpoint)."""

    slot_bytes: int

    def fits(self, tensor_bytes: list[int], payload_bytes: int = 0) -> bool:
        return len(tensor_bytes) <= MAX_TENSORS and message_bytes(tensor_bytes, payload_bytes) <= self.slot_bytes

    def send(self, message: SlotMessage) -> None:
        """Send the message (tensors on any device): into the next outgoing slot, or as a frame."""
        self.send_parts(message.kind, message.iteration_id, message.layer, message.tensors, message.payload)

    def send_parts(self, kind: int, iteration_id: int, layer: int, tensors: Sequence[torch.Tensor],
                   payload: bytes = b"") -> None:
        raise NotImplementedError


class ShmEndpoint(SlotSender):
    """One side's sender on its outgoing ring and receiver on its incoming ring (one thread at a time)."""

    def __init__(self, segment: ShmSegment, outgoing: str, incoming: str, spin_s: float):
        self._segment = segment
        self.outgoing = Doorbell(segment.mapping, _DOORBELL_AT[outgoing], spin_s)
        self.incoming = Doorbell(segment.mapping, _DOORBELL_AT[incoming], spin_s)
        self._slots = {
            direction: [torch.frombuffer(segment.mapping, dtype=torch.uint8, count=segment.slot_bytes,
                                         offset=segment.ring_offset(direction, index))
                        for index in range(segment.num_slots)]
            for direction in (outgoing, incoming)
        }
        self._outgoing_name, self._incoming_name = outgoing, incoming
        self._send_layouts: dict[tuple, tuple] = {}
        self._receive_layouts: dict[tuple, tuple] = {}
        self._mapping = segment.mapping
        self._num_slots = segment.num_slots
        self._bases = [segment.ring_offset(incoming, index) for index in range(segment.num_slots)]
        self._tables_written: list[bytes | None] = [None] * segment.num_slots  # per outgoing slot
        self._incoming_words = self.incoming.words
        self.num_sent = 0
        self.num_received = 0
        self.slot_bytes = segment.slot_bytes

    def send_parts(self, kind: int, iteration_id: int, layer: int, tensors: Sequence[torch.Tensor],
                   payload: bytes = b"") -> None:
        """send() without building a SlotMessage (the per-layer path). A contiguous CPU tensor is
        copied with one memmove into its cached slot address (its size is the layout's: the layout
        is keyed on every tensor's shape and dtype); any other goes through Tensor.copy_."""
        index = self.num_sent % self._num_slots
        key = (index, len(payload), *[t.shape for t in tensors], *[t.dtype for t in tensors])
        layout = self._send_layouts.get(key)
        if layout is None:
            layout = self._send_layouts[key] = self._send_layout(index, tensors, len(payload))
        base, table, copies, payload_at = layout
        for (view, address, num_bytes), tensor in zip(copies, tensors):
            if tensor.is_cpu and tensor.is_contiguous():
                _memmove(address, tensor.data_ptr(), num_bytes)
            else:
                view.copy_(tensor)
        mapping = self._mapping
        if payload:
            mapping[payload_at:payload_at + len(payload)] = payload
        if self._tables_written[index] is not table:  # the peer never writes our slots: once per layout
            mapping[base + _SLOT_HEADER.size:base + _SLOT_HEADER.size + len(table)] = table
            self._tables_written[index] = table
        _SLOT_HEADER.pack_into(mapping, base, kind, layer, iteration_id, len(tensors), len(payload))
        self.num_sent += 1
        self.outgoing.post(self.num_sent)

    def _send_layout(self, index: int, tensors: list[torch.Tensor], payload_bytes: int):
        """Where a message of these tensors goes in slot `index`: (slot offset, tensor table,
        (view, its address, its bytes) per tensor, payload offset)."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        if not self.fits(sizes, payload_bytes):
            raise ValueError(f"a message of {message_bytes(sizes, payload_bytes)} bytes does not fit a "
                             f"{self.slot_bytes}-byte slot")
        slot = self._slots[self._outgoing_name][index]
        table, views, offset = bytearray(), [], SLOT_HEADER_BYTES
        for tensor, num_bytes in zip(tensors, sizes):
            if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPE_CODES:
                raise ValueError(f"a slot holds tensors of <= {MAX_DIMS} dims in {sorted(map(str, _DTYPE_CODES))}")
            dims = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
            table += _TENSOR_ENTRY.pack(_DTYPE_CODES[tensor.dtype], tensor.dim(), *dims, 0, offset)
            view = slot[offset:offset + num_bytes].view(tensor.dtype).view(tensor.shape)
            views.append((view, view.data_ptr(), num_bytes))
            offset += _aligned(num_bytes)
        base = self._segment.ring_offset(self._outgoing_name, index)
        self._trim(self._send_layouts)
        return base, bytes(table), tuple(views), base + offset

    def receive(self, deadline_s: float | None, should_stop=_never) -> SlotMessage | None:
        """The next incoming message; None when should_stop() or the deadline (monotonic) comes first.
        Its tensors are the slot's cached views (a tuple shared by every message of that layout)."""
        expected = (self.num_received + 1) & 0xFFFFFFFF
        self.incoming.seen_ns = 0
        if self._incoming_words[0] != expected:  # not there yet: wait (spin, then futex)
            if not self.incoming.wait(expected, deadline_s, should_stop):
                return None
            seq = self._incoming_words[0]
            if seq != expected:
                if should_stop():
                    return None
                raise ShmProtocolError(f"doorbell: sequence {seq}, expected {expected}")
        if should_stop():
            return None
        index = self.num_received % self._num_slots
        base = self._bases[index]
        mapping = self._mapping
        kind, layer, iteration_id, num_tensors, payload_bytes = _SLOT_HEADER.unpack_from(mapping, base)
        if num_tensors > MAX_TENSORS:
            raise ShmProtocolError(f"slot.num_tensors: {num_tensors} > {MAX_TENSORS}")
        table = mapping[base + _SLOT_HEADER.size:base + _SLOT_HEADER.size + num_tensors * _TENSOR_ENTRY.size]
        layout = self._receive_layouts.get((index, table))
        if layout is None:
            layout = self._receive_layouts[(index, table)] = self._receive_layout(index, table)
        tensors, end = layout
        if end + payload_bytes > self.slot_bytes:
            raise ShmProtocolError(f"slot.payload_bytes: {payload_bytes} bytes do not fit after the tensors")
        payload = mapping[base + end:base + end + payload_bytes] if payload_bytes else b""
        self.num_received += 1
        return SlotMessage(kind, iteration_id, layer, tensors, payload)

    def _receive_layout(self, index: int, table: bytes) -> tuple[tuple[torch.Tensor, ...], int]:
        """The views a tensor table describes in slot `index`, checked; and where the payload starts."""
        views, end = table_views(self._slots[self._incoming_name][index], table)
        self._trim(self._receive_layouts)
        return views, end

    @staticmethod
    def _trim(cache: dict) -> None:
        """Layouts are cached (every layer of an iteration has the same shapes); a bounded number."""
        if len(cache) >= _MAX_CACHED_LAYOUTS:
            cache.clear()

    def release(self) -> None:
        self._send_layouts.clear()
        self._receive_layouts.clear()
        self._slots.clear()
        self._tables_written = [None] * self._num_slots
        self.outgoing.release()
        self.incoming.release()
