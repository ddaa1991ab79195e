"""The fused C copy + CRC32C gives the crc32c package's values exactly, and copy_in_place's
checksums do not depend on which path computed them (they are on the wire)."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from dualpace.engine.transfer import kv_copy_native, shm_kv_copy
from dualpace.engine.transfer.shm_kv_copy import copy_in_place, layer_checksums, slot_runs

lib = kv_copy_native.get()
needs_native = pytest.mark.skipif(lib is None, reason="fused KV copy not built here (no gcc or no SSE4.2)")
LANES = 3 * 16384  # kv_copy_native.c's round: sizes around it take both the lane and the tail loops
SMALL_ROUNDS = [3 * 4096 - 1, 3 * 4096, 3 * 4096 + 3 * 1024 + 8, 3 * 1024, LANES + 3 * 4096 + 3 * 1024 + 5]  # the smaller lanes
FOLD_SIZES = [255, 256, 257, 271, 272, 300, 511, 512, 513, 767, 768 + 15, 4096 + 16 * 7 + 3]  # the folding loop's edges
PATHS_HERE = {lib.dp_kv_set_crc_path(path) for path in (0, 1, 2)} if lib is not None else set()
CRC_PATHS = [pytest.param(path, id=name, marks=pytest.mark.skipif(path not in PATHS_HERE, reason=f"no {name} here"))
             for path, name in ((1, "fold-zmm"), (2, "fold-ymm"), (0, "crc32-lanes"))]


@pytest.fixture(params=CRC_PATHS)
def crc_path(request):
    """Each test below on every CRC loop of the library the CPU has (back to the widest after)."""
    if lib is not None:
        assert lib.dp_kv_set_crc_path(request.param) == request.param
    yield request.param
    if lib is not None:
        lib.dp_kv_set_crc_path(1)


@needs_native
@pytest.mark.parametrize("num_bytes", [0, 1, 7, 8, 9, 63, LANES - 1, LANES, LANES + 13, 5 * LANES + 4095, 200_003,
                                       *SMALL_ROUNDS, *FOLD_SIZES])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_copy_and_checksum_equal_the_package_on_odd_sizes_and_offsets(num_bytes, offset, crc_path):
    data = np.random.default_rng(num_bytes + offset).integers(0, 256, num_bytes + offset, dtype=np.uint8)
    src = data[offset:]
    dst_buffer = np.zeros(num_bytes + 3, dtype=np.uint8)
    dst = dst_buffer[3:]  # unaligned on the target too
    for start in (0, 0xDEADBEEF):
        assert lib.dp_copy_crc32c(dst.ctypes.data, src.ctypes.data, num_bytes, start) == crc32c.crc32c(src, start)
        assert np.array_equal(dst, src)
        assert not dst_buffer[:3].any()  # nothing written before the target
        assert lib.dp_copy_crc32c(None, src.ctypes.data, num_bytes, start) == crc32c.crc32c(src, start)


@needs_native
def test_the_known_check_value(crc_path):
    message = ctypes.create_string_buffer(b"123456789", 9)
    assert lib.dp_copy_crc32c(None, ctypes.addressof(message), 9, 0) == 0xE3069283
    zeros = ctypes.create_string_buffer(1024)  # long enough for the folding loop: 32 zero bytes x 32
    assert lib.dp_copy_crc32c(None, ctypes.addressof(zeros), 1024, 0) == crc32c.crc32c(bytes(1024))


@needs_native
def test_the_widest_folding_loop_is_chosen_where_the_cpu_has_it():
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split("\n\n")[0].split() if cpuinfo.exists() else []
    ymm = all(f in flags for f in ("vpclmulqdq", "pclmulqdq", "avx2"))
    zmm = ymm and all(f in flags for f in ("avx512f", "avx512bw", "avx512vl"))
    assert lib.dp_kv_set_crc_path(1) == (1 if zmm else 2 if ymm else 0)
    assert kv_copy_native.crc_path() == kv_copy_native.CRC_PATHS[1 if zmm else 2 if ymm else 0]


@needs_native
@pytest.mark.parametrize("dst_offset", [0, 3, 64])
def test_streaming_stores_copy_the_same_bytes_aligned_or_not(crc_path, dst_offset):
    """Non-temporal stores where the target is 64-byte aligned, ordinary ones where it is not."""
    src = np.random.default_rng(dst_offset).integers(0, 256, 70_001, dtype=np.uint8)
    buffer = np.zeros(70_001 + 128, dtype=np.uint8)
    dst = buffer[(-buffer.ctypes.data) % 64 + dst_offset:][:70_001]
    runs = np.array([[0, 0, 30_000], [30_000, 30_000, 40_001]], dtype=np.int64)  # slots of one byte
    # K copied to dst, V (the same source) only checksummed: the layer's CRC is over both, in order.
    crc = lib.dp_kv_layer_copy_crc32c(dst.ctypes.data, None, src.ctypes.data, src.ctypes.data, runs.ctypes.data, 2, 1, 1)
    assert crc == crc32c.crc32c(src, crc32c.crc32c(src))
    assert np.array_equal(dst, src)


def _pools(dtype, seed, num_blocks=40):
    generator = torch.Generator().manual_seed(seed)
    shape = (3, num_blocks, 16, 2, 64)  # a layer's runs long enough for the three lanes
    return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stream", [False, True], ids=["stores", "streaming-stores"])
def test_copy_in_place_checksums_and_bytes_are_the_same_with_and_without_the_fused_loop(monkeypatch, dtype, crc_path,
                                                                                        stream):
    monkeypatch.setattr(shm_kv_copy, "STREAM_MIN_BYTES", 0 if stream else 2**62)
    src_k, src_v = _pools(dtype, 0)
    src_slot_ids = [*range(3, 300), *range(400, 410), 7]  # runs broken on both sides
    dst_slot_ids = [*range(320, 617), *range(10, 20), 639]
    results = []
    for native in (True, False):
        if not native:  # (copy_in_place without a stop event: all layers in one C call)
            monkeypatch.setattr(kv_copy_native, "get", lambda: None)
        dst_k, dst_v = _pools(dtype, 1)
        sent = copy_in_place(src_k, src_v, dst_k, dst_v, slot_runs(src_slot_ids, dst_slot_ids))
        results.append((sent, dst_k, dst_v, layer_checksums(dst_k, dst_v, dst_slot_ids)))
    (sent, k, v, landed), (sent_np, k_np, v_np, landed_np) = results
    assert sent == sent_np == landed == landed_np
    assert torch.equal(k, k_np) and torch.equal(v, v_np)


@needs_native
def test_one_call_over_all_layers_equals_one_call_per_layer(crc_path):
    """Without a stop event the layers go in one C call; with one, a call per layer (to stop between)."""
    src_k, src_v = _pools(torch.float32, 0)
    slot_ids = [*range(5, 21), *range(100, 103)]  # 16 + 3 tokens: the small lanes and the tail
    per_layer_k, per_layer_v = _pools(torch.float32, 1)
    all_k, all_v = _pools(torch.float32, 1)
    per_layer = copy_in_place(src_k, src_v, per_layer_k, per_layer_v, slot_runs(slot_ids, slot_ids),
                              stop=threading.Event())
    at_once = copy_in_place(src_k, src_v, all_k, all_v, slot_runs(slot_ids, slot_ids))
    assert per_layer == at_once == layer_checksums(all_k, all_v, slot_ids)
    assert at_once[1:] == layer_checksums(all_k, all_v, slot_ids, layers=range(1, 3))
    assert torch.equal(per_layer_k, all_k) and torch.equal(per_layer_v, all_v)


@needs_native
def test_slots_or_layers_outside_the_pool_are_refused_before_any_write():
    src_k, src_v = _pools(torch.float32, 0, num_blocks=2)
    dst_k, dst_v = _pools(torch.float32, 1, num_blocks=2)
    before = dst_k.clone()
    with pytest.raises(IndexError):
        copy_in_place(src_k, src_v, dst_k, dst_v, slot_runs([0, 1], [31, 32]))
    with pytest.raises(IndexError):
        layer_checksums(src_k, src_v, [0, 1], layers=range(2, 4))
    assert torch.equal(dst_k, before)


def test_without_the_library_the_numpy_path_still_copies(monkeypatch):
    monkeypatch.setattr(kv_copy_native, "get", lambda: None)
    src_k, src_v = _pools(torch.float32, 0, num_blocks=2)
    dst_k, dst_v = _pools(torch.float32, 1, num_blocks=2)
    sent = copy_in_place(src_k, src_v, dst_k, dst_v, slot_runs([0, 1, 2], [5, 6, 7]))
    assert sent == shm_kv_copy.layer_checksums(dst_k, dst_v, [5, 6, 7])
    assert torch.equal(dst_k.view(3, 32, 2, 64)[:, 5:8], src_k.view(3, 32, 2, 64)[:, 0:3])
