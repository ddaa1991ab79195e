"""Copy a request's KV straight into another engine's reserved slots, and the layer checksums.

Both pools are [num_layers, num_blocks, block_size, num_kv_heads, head_dim] for K and V
(dualpace.kv.storage). Slots are flat (block * block_size + offset). A transfer's source
slots and target slots are cut into runs that are contiguous on both sides, and each run is
one strided copy over all layers at once: a fresh pool with equal block sizes gives one run
for the whole request, a fragmented one a run per block.

The checksum of a layer is the CRC32C (dualpace.engine.kv_checksum's, in hardware) of its K
bytes in token order followed by its V bytes in token order: the checksum a gRPC chunk covering
the whole layer would carry. Each side
computes it over its own memory, so the target checks what actually landed in its blocks.
"""

from __future__ import annotations

import threading
from typing import Protocol

import crc32c
import numpy as np
import torch

# A transfer this small is copied (and verified) on the event loop itself: the hop to a worker
# thread costs a wake-up (tens of microseconds idle, milliseconds on a loaded machine), more than
# copying and checksumming 1 MiB (about 0.1 ms + 0.3 ms here). Larger ones go to the worker
# pools, so that the loop keeps serving streams meanwhile.
INLINE_MAX_BYTES = 2**20


class _Pool(Protocol):
    k: torch.Tensor
    num_layers: int
    num_kv_heads: int
    head_dim: int


def transfer_bytes(storage: _Pool, num_tokens: int) -> int:
    """K + V bytes of `num_tokens` tokens in every layer of `storage`."""
    return 2 * storage.num_layers * num_tokens * storage.num_kv_heads * storage.head_dim * storage.k.element_size()


def slot_runs(src_slot_ids: list[int], dst_slot_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs, contiguous in both slot lists, in token order."""
    if len(src_slot_ids) != len(dst_slot_ids):
        raise ValueError(f"{len(src_slot_ids)} source slots for {len(dst_slot_ids)} target slots")
    if not src_slot_ids:
        return []
    src = np.asarray(src_slot_ids, dtype=np.int64)
    dst = np.asarray(dst_slot_ids, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends)]


def _flat(pool: torch.Tensor) -> torch.Tensor:
    """[layers, blocks, block_size, heads, dim] -> [layers, slots, heads, dim] (a view)."""
    layers, blocks, block_size, heads, dim = pool.shape
    return pool.view(layers, blocks * block_size, heads, dim)


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (16-bit floats through int16)."""
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")


def layer_checksums(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_ids: list[int]) -> list[int]:
    """Per layer: CRC-32 of K then V over `slot_ids`, in order (CPU pools)."""
    runs = slot_runs(slot_ids, slot_ids)
    k_flat, v_flat = _flat(k_pool), _flat(v_pool)
    checksums = []
    for layer in range(k_pool.shape[0]):
        crc = 0
        for flat in (k_flat, v_flat):
            for start, _, length in runs:
                crc = crc32c.crc32c(_raw(flat[layer, start:start + length]), crc)
        checksums.append(crc)
    return checksums


def copy_in_place(src_k: torch.Tensor, src_v: torch.Tensor, src_slot_ids: list[int],
                  dst_k: torch.Tensor, dst_v: torch.Tensor, dst_slot_ids: list[int],
                  stop: threading.Event | None = None) -> list[int]:
    """Copy K and V of the source slots into the target slots; returns the layer checksums of
    what was sent (over the source when it is in host memory, else over what was written).
    Stops between runs once `stop` is set (then raises InterruptedError)."""
    src_k_flat, src_v_flat = _flat(src_k), _flat(src_v)
    dst_k_flat, dst_v_flat = _flat(dst_k), _flat(dst_v)
    for src_start, dst_start, length in slot_runs(src_slot_ids, dst_slot_ids):
        if stop is not None and stop.is_set():
            raise InterruptedError("KV copy stopped")
        dst_k_flat[:, dst_start:dst_start + length].copy_(src_k_flat[:, src_start:src_start + length])
        dst_v_flat[:, dst_start:dst_start + length].copy_(src_v_flat[:, src_start:src_start + length])
    if src_k.device.type == "cpu":
        return layer_checksums(src_k, src_v, src_slot_ids)
    return layer_checksums(dst_k, dst_v, dst_slot_ids)
