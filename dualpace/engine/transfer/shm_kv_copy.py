"""Copy a request's KV straight into another engine's reserved slots, and the layer checksums.

Both pools are [num_layers, num_blocks, block_size, num_kv_heads, head_dim] for K and V
(dualpace.kv.storage). Slots are flat (block * block_size + offset). A transfer's source
slots and target slots are cut into runs that are contiguous on both sides.

The checksum of a layer is the CRC32C (dualpace.engine.transfer.kv_checksum's, in hardware) of its K
bytes in token order followed by its V bytes in token order (the data socket's layer checksum
too). It is computed once, by the sender, in the same pass as the copy: in C where kv_copy_native
is built (each 8-byte word loaded once, stored, and CRC'd from the register), else in pieces of
CHUNK_BYTES, each CRC'd right after it was copied while still in cache; the source is read from
memory once either way (copy and checksum cost about one copy). The target does not read its
blocks back (dualpace.engine.transfer.kv_shm_import says why that is safe on one host).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import crc32c
import numpy as np
import torch

from dualpace.engine.transfer import kv_copy_native

# A transfer this small is copied on the event loop itself: the hop to a worker thread costs a
# wake-up (tens of microseconds idle, milliseconds on a loaded machine), more than copying (and
# checksumming while in cache) 4 MiB, about 1 ms here. Larger ones go to the worker pools, so that
# the loop keeps serving streams meanwhile.
INLINE_MAX_BYTES = 4 * 2**20

# A transfer at least this large is copied with non-temporal stores (kv_copy_native, where its zmm
# folding loop runs): larger than the two cores' L2 caches, its target blocks are not in cache when
# written, and an ordinary store first reads the line it writes. Measured on a 2-core host
# (medians over six alternated pairs): the sender's copy of 1024 tokens (23.6 MB) 4.8 ms against 5.7.
# Smaller ones keep ordinary stores: their lines stay in cache for the target's next step.
STREAM_MIN_BYTES = 8 * 2**20

# The piece copied and then CRC'd at once on the sender: small enough to be still in the core's
# L2 cache (512 KB per core on Zen 3, 1-2 MB on recent Xeons) when the CRC reads it back.
CHUNK_BYTES = 256 * 1024


class _Pool(Protocol):
    k: torch.Tensor
    num_layers: int
    num_kv_heads: int
    head_dim: int


def transfer_bytes(storage: _Pool, num_tokens: int) -> int:
    """K + V bytes of `num_tokens` tokens in every layer of `storage`."""
    return 2 * storage.num_layers * num_tokens * storage.num_kv_heads * storage.head_dim * storage.k.element_size()


def slot_runs(src_slot_ids: Sequence[int], dst_slot_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs, contiguous in both slot lists (or arrays), in token order."""
    if len(src_slot_ids) != len(dst_slot_ids):
        raise ValueError(f"{len(src_slot_ids)} source slots for {len(dst_slot_ids)} target slots")
    if not len(src_slot_ids):
        return []
    src = np.asarray(src_slot_ids, dtype=np.int64)
    dst = np.asarray(dst_slot_ids, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends)]


def runs_into(src_slot_ids: Sequence[int], dst_runs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """slot_runs of the source slots into the target slots that `dst_runs` name ((first slot, number of
    slots) runs of consecutive slots: a reservation's, KVBlockManager.slot_runs). A
    plain loop over the source slots within each target run: cold (a sender woken from idle) it cost
    28 / 87 us for 16 / 1024 tokens where numpy's slot_runs over the expanded slots cost 217 / 306."""
    if sum(length for _, length in dst_runs) != len(src_slot_ids):
        raise ValueError(f"{len(src_slot_ids)} source slots for target runs of {sum(n for _, n in dst_runs)} slots")
    runs = []
    first = 0
    for dst_start, length in dst_runs:
        token, end = first, first + length
        while token < end:
            src_start = src_slot_ids[token]
            next_token = token + 1
            while next_token < end and src_slot_ids[next_token] == src_start + next_token - token:
                next_token += 1
            runs.append((src_start, dst_start + token - first, next_token - token))
            token = next_token
        first = end
    return runs


def _flat(pool: torch.Tensor) -> torch.Tensor:
    """[layers, blocks, block_size, heads, dim] -> [layers, slots, heads, dim] (a view)."""
    layers, blocks, block_size, heads, dim = pool.shape
    return pool.view(layers, blocks * block_size, heads, dim)


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor, without a copy (16-bit floats through int16)."""
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _slot_bytes(pool: torch.Tensor) -> int:
    """Bytes of one token of one layer of a [layers, blocks, block_size, heads, dim] pool."""
    return pool.shape[3] * pool.shape[4] * pool.element_size()


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B")


def _native_layers(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor | None, dst_v: torch.Tensor | None,
                   runs: list[tuple[int, int, int]], layers: range, stop: threading.Event | None,
                   stream: bool = False) -> list[int] | None:
    """Per layer: the fused C copy (none when dst_k is None) + CRC32C of kv_copy_native; None where
    it cannot be used (not built here, or a pool not contiguous), for the numpy + crc32c path. One
    C call over all the layers where there is no `stop` to look at between them, else one per layer.
    `stream`: non-temporal stores (see STREAM_MIN_BYTES)."""
    lib = kv_copy_native.get()
    pools = [t for t in (src_k, src_v, dst_k, dst_v) if t is not None]
    if lib is None or not all(t.is_contiguous() for t in pools):
        return None
    run_array = np.ascontiguousarray(np.asarray(runs, dtype=np.int64).reshape(-1, 3))
    _check_bounds(runs, src_k, dst_k, layers)
    slot_bytes = _slot_bytes(src_k)
    layer_bytes = [t.stride(0) * t.element_size() for t in (src_k, dst_k if dst_k is not None else src_k)]
    base = [t.data_ptr() if t is not None else None for t in (src_k, src_v, dst_k, dst_v)]
    if stop is None and len(layers):  # nothing to stop between layers: all of them in one call
        out = np.zeros(len(layers), dtype=np.uint32)
        src = [b + layers.start * layer_bytes[0] for b in base[:2]]
        dst = [b + layers.start * layer_bytes[1] if b is not None else None for b in base[2:]]
        lib.dp_kv_layers_copy_crc32c(*dst, *src, layer_bytes[0], layer_bytes[1], len(layers),
                                     run_array.ctypes.data, len(runs), slot_bytes, out.ctypes.data, int(stream))
        return out.tolist()
    checksums = []
    for layer in layers:
        _check_stop(stop)
        src = [b + layer * layer_bytes[0] for b in base[:2]]
        dst = [b + layer * layer_bytes[1] if b is not None else None for b in base[2:]]
        checksums.append(lib.dp_kv_layer_copy_crc32c(*dst, *src, run_array.ctypes.data, len(runs), slot_bytes,
                                                     int(stream)))
    return checksums


def _check_bounds(runs: list[tuple[int, int, int]], src_k: torch.Tensor, dst_k: torch.Tensor | None,
                  layers: range) -> None:
    """The C loop does not check bounds: numpy's IndexError, raised here instead (a loop over the runs,
    a few: numpy's calls on them cost more, cold)."""
    if len(layers) and (min(layers) < 0 or max(layers) >= src_k.shape[0]):
        raise IndexError(f"layers {layers} outside a pool of {src_k.shape[0]} layers")
    for column, pool in ((0, src_k), (1, dst_k)):
        if pool is None:
            continue
        num_slots = pool.shape[1] * pool.shape[2]
        if any(run[column] < 0 or run[column] + run[2] > num_slots for run in runs):
            raise IndexError(f"slot ids outside a pool of {num_slots} slots")


def layer_checksums(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_ids: list[int],
                    layers: range | None = None) -> list[int]:
    """Per layer of `layers` (default: all): CRC32C of K then V over `slot_ids`, in order (CPU pools)."""
    return _run_checksums(k_pool, v_pool, slot_runs(slot_ids, slot_ids), layers)


def _run_checksums(k_pool: torch.Tensor, v_pool: torch.Tensor, runs: list[tuple[int, int, int]],
                   layers: range | None = None) -> list[int]:
    """layer_checksums over the slots that `runs` name by their first member ((start, _, length))."""
    layers = layers if layers is not None else range(k_pool.shape[0])
    native = _native_layers(k_pool, v_pool, None, None, runs, layers, None)
    if native is not None:
        return native
    k_flat, v_flat = _array(_flat(k_pool)), _array(_flat(v_pool))
    checksums = []
    for layer in layers:
        crc = 0
        for flat in (k_flat, v_flat):
            for start, _, length in runs:
                crc = crc32c.crc32c(_bytes(flat[layer, start:start + length]), crc)
        checksums.append(crc)
    return checksums


def layer_checksummer(k_pool: torch.Tensor, v_pool: torch.Tensor, slot_ids: list[int]) -> Callable[[int], int]:
    """checksum(layer): layer_checksums of one layer, its runs and bounds prepared once (a stream that
    checksums each layer next to moving it: per call, layer_checksums' setup cost ~0.5 ms on a busy
    2-core machine, more than the CRC of a 0.8 MB layer)."""
    lib = kv_copy_native.get()
    if lib is None or not (k_pool.is_contiguous() and v_pool.is_contiguous()) or k_pool.device.type != "cpu":
        return lambda layer: layer_checksums(k_pool, v_pool, slot_ids, range(layer, layer + 1))[0]
    runs = slot_runs(slot_ids, slot_ids)
    run_array = np.ascontiguousarray(np.asarray(runs, dtype=np.int64).reshape(-1, 3))
    _check_bounds(runs, k_pool, None, range(k_pool.shape[0]))
    slot_bytes = _slot_bytes(k_pool)
    layer_bytes = k_pool.stride(0) * k_pool.element_size()
    k_base, v_base = k_pool.data_ptr(), v_pool.data_ptr()

    def checksum(layer: int) -> int:
        if not 0 <= layer < k_pool.shape[0]:
            raise IndexError(f"layer {layer} outside a pool of {k_pool.shape[0]} layers")
        return lib.dp_kv_layer_copy_crc32c(None, None, k_base + layer * layer_bytes, v_base + layer * layer_bytes,
                                           run_array.ctypes.data, len(runs), slot_bytes, 0)
    return checksum


def copy_in_place(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                  runs: list[tuple[int, int, int]], stop: threading.Event | None = None) -> list[int]:
    """Copy K and V of the source slots into the target slots (`runs`: slot_runs or runs_into), in one
    thread; returns the layer checksums of what was sent. A host source is copied by kv_copy_native's fused loop (each
    word loaded once, stored and CRC'd from the register) where it is built; else in pieces of about
    CHUNK_BYTES, each CRC'd right after it was copied, while it is still in cache: either way the
    source is read from memory once. A device source is copied first and checksummed over what was
    written. Stops between layers once `stop` is set (then raises InterruptedError)."""
    if src_k.device.type != "cpu":
        return _copy_from_device(src_k, src_v, dst_k, dst_v, runs, stop)
    layers = range(src_k.shape[0])
    whole_transfer_bytes = 2 * sum(length for _, _, length in runs) * _slot_bytes(src_k) * src_k.shape[0]
    native = _native_layers(src_k, src_v, dst_k, dst_v, runs, layers, stop, whole_transfer_bytes >= STREAM_MIN_BYTES)
    if native is not None:
        return native
    src_k_flat, src_v_flat = _array(_flat(src_k)), _array(_flat(src_v))
    dst_k_flat, dst_v_flat = _array(_flat(dst_k)), _array(_flat(dst_v))
    token_bytes = src_k_flat[0, 0].nbytes
    tokens_per_piece = max(1, CHUNK_BYTES // token_bytes)
    checksums = []
    for layer in layers:
        _check_stop(stop)
        crc = 0
        for src_flat, dst_flat in ((src_k_flat, dst_k_flat), (src_v_flat, dst_v_flat)):
            for src_start, dst_start, length in runs:
                for offset in range(0, length, tokens_per_piece):
                    count = min(tokens_per_piece, length - offset)
                    piece = src_flat[layer, src_start + offset:src_start + offset + count]
                    np.copyto(dst_flat[layer, dst_start + offset:dst_start + offset + count], piece)
                    crc = crc32c.crc32c(_bytes(piece), crc)
        checksums.append(crc)
    return checksums


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise InterruptedError("KV copy stopped")


def _copy_from_device(src_k, src_v, dst_k, dst_v, runs, stop) -> list[int]:
    """One strided copy per run over all layers, then the checksums over the written host slots."""
    src_k_flat, src_v_flat = _flat(src_k), _flat(src_v)
    dst_k_flat, dst_v_flat = _flat(dst_k), _flat(dst_v)
    for src_start, dst_start, length in runs:
        _check_stop(stop)
        dst_k_flat[:, dst_start:dst_start + length].copy_(src_k_flat[:, src_start:src_start + length])
        dst_v_flat[:, dst_start:dst_start + length].copy_(src_v_flat[:, src_start:src_start + length])
    return _run_checksums(dst_k, dst_v, [(dst_start, dst_start, length) for _, dst_start, length in runs])
