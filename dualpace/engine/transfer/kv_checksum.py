"""The one checksum over KV bytes that cross a process boundary: one per layer of a transfer.

CRC32C (Castagnoli), from the `crc32c` package: the CPU's CRC instruction (SSE4.2 on x86-64, the CRC
extension on ARMv8) with a software fallback, and the GIL released on large buffers, so the source's
export and the target's import threads checksum in parallel with the step loop. A CRC (not a hash
such as xxHash) because what it guards against is corruption, where a CRC's guarantee on burst and
few-bit errors is the point; CRC32C rather than zlib's CRC32 because it has that hardware
instruction. Computed once per side: by the source over what it sent, by the target over what
landed (the native copy loop computes the same value, shm_kv_copy). Torch-free; takes any buffer
(bytes, memoryview, a numpy array).
"""

from __future__ import annotations

import crc32c

Buffer = bytes | bytearray | memoryview  # or anything else with the buffer protocol


def kv_checksum(k: Buffer, v: Buffer) -> int:
    """CRC32C of K's bytes followed by V's, as an unsigned 32-bit int."""
    return crc32c.crc32c(v, crc32c.crc32c(k))
