"""A KV pool in a shared-memory segment (a memfd), and the view another process maps of it.

The segment is one header page followed by the K tensor and the V tensor of a KVStorage,
[num_layers, num_blocks, block_size, num_kv_heads, head_dim] each, page-aligned. The
header holds a magic, a random token (the proof that a mapping is of this segment) and the
geometry, so a process that maps it needs nothing else to address its blocks.

The owner (`SharedKvMemory`) is passed to KVStorage as its memory; fresh memfd pages read
as zeros, as torch.zeros would give. A memfd has no name: it goes away with the last
process that maps it, however that process ends. Both the owner's mapping and another
process's are faulted in ahead by a background thread (dualpace.engine.transfer.shm_populate).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass

import torch

from dualpace.engine.transfer.kv_bytes import DTYPE_NAMES, DTYPES_BY_NAME
from dualpace.engine.transfer.shm_populate import populate
from dualpace.errors import InvalidArgument

MAGIC = b"DPKVSEG1"
TOKEN_BYTES = 16
HEADER_BYTES = mmap.PAGESIZE
_HEADER = struct.Struct("<8s16s5I16sQQQ")  # magic, token, layers, blocks, block size, heads, dim, dtype, k/v/total


def _round_up(num_bytes: int) -> int:
    return -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass(frozen=True)
class SegmentGeometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    k_offset_bytes: int
    v_offset_bytes: int
    total_bytes: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @classmethod
    def for_shape(cls, shape: tuple[int, ...], dtype: torch.dtype) -> SegmentGeometry:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = shape
        tensor_bytes = _round_up(num_layers * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize)
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, DTYPE_NAMES[dtype],
                   HEADER_BYTES, HEADER_BYTES + tensor_bytes, HEADER_BYTES + 2 * tensor_bytes)


def _tensors(buffer: mmap.mmap, geometry: SegmentGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = DTYPES_BY_NAME[geometry.dtype]
    k = torch.frombuffer(buffer, dtype=dtype, count=geometry.num_elements, offset=geometry.k_offset_bytes)
    v = torch.frombuffer(buffer, dtype=dtype, count=geometry.num_elements, offset=geometry.v_offset_bytes)
    return k.view(geometry.shape), v.view(geometry.shape)


class SharedKvMemory:
    """The owner's segment: KVStorage allocates its K and V here instead of in private memory."""

    def __init__(self):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.fd: int | None = None
        self.geometry: SegmentGeometry | None = None
        self._buffer: mmap.mmap | None = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fd is not None:
            raise RuntimeError("this shared KV memory already holds a pool")
        geometry = SegmentGeometry.for_shape(shape, dtype)
        fd = os.memfd_create("dualpace-kv", os.MFD_CLOEXEC)
        os.ftruncate(fd, geometry.total_bytes)
        buffer = mmap.mmap(fd, geometry.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        buffer[:_HEADER.size] = _HEADER.pack(
            MAGIC, self.token, geometry.num_layers, geometry.num_blocks, geometry.block_size, geometry.num_kv_heads,
            geometry.head_dim, geometry.dtype.encode(), geometry.k_offset_bytes, geometry.v_offset_bytes,
            geometry.total_bytes)
        self.fd, self.geometry, self._buffer = fd, geometry, buffer
        populate(buffer, "this engine's shared KV pool")  # no first-touch faults in the first hand-offs
        return _tensors(buffer, geometry)


class MappedKvSegment:
    """Another process's KV pool, mapped here after its header proved it is the segment named."""

    def __init__(self, buffer: mmap.mmap, geometry: SegmentGeometry):
        self.geometry = geometry
        self.k, self.v = _tensors(buffer, geometry)
        self._buffer = buffer

    @classmethod
    def open(cls, fd: int, expected_token: bytes) -> MappedKvSegment:
        """Map the segment behind `fd` (closed here) if its header holds `expected_token`."""
        try:
            total = os.fstat(fd).st_size
            if total < HEADER_BYTES:
                raise InvalidArgument("shm segment", f"is {total} bytes, smaller than its header")
            buffer = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        (magic, token, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype_name, k_offset, v_offset,
         total_bytes) = _HEADER.unpack(buffer[:_HEADER.size])
        dtype = dtype_name.rstrip(b"\0").decode(errors="replace")
        if magic != MAGIC or not secrets.compare_digest(token, expected_token):
            buffer.close()
            raise InvalidArgument("shm segment", "its header does not hold the token the owner named")
        geometry = SegmentGeometry(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, k_offset,
                                   v_offset, total_bytes)
        if dtype not in DTYPES_BY_NAME or total_bytes != total or geometry != SegmentGeometry.for_shape(
                geometry.shape, DTYPES_BY_NAME[dtype]):
            buffer.close()
            raise InvalidArgument("shm segment", f"inconsistent geometry {geometry} for {total} bytes")
        populate(buffer, "a mapped KV pool")  # the sender's page-table entries, before its first copies
        return cls(buffer, geometry)
