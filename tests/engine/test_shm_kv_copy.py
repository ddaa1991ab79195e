"""The shm path's copy: pieces copied then CRC'd in cache give the checksums the target computes."""

from __future__ import annotations

import threading

import pytest
import torch

from dualpace.engine.transfer import shm_kv_copy
from dualpace.engine.transfer.shm_kv_copy import copy_in_place, layer_checksums, slot_runs


def _pools(dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 5, 4, 2, 8, generator=generator).to(dtype),
            torch.randn(3, 5, 4, 2, 8, generator=generator).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 40, 1 << 20])  # a piece per token, a few tokens, a whole run
def test_copy_writes_the_slots_and_returns_the_checksums_the_target_computes(monkeypatch, dtype, chunk_bytes):
    monkeypatch.setattr(shm_kv_copy, "CHUNK_BYTES", chunk_bytes)
    src_k, src_v = _pools(dtype, 0)
    dst_k, dst_v = _pools(dtype, 1)
    before_k, before_v = dst_k.clone(), dst_v.clone()
    src_slot_ids = [3, 4, 5, 6, 7, 8, 12, 0, 1]  # runs broken on both sides
    dst_slot_ids = [10, 11, 12, 13, 2, 3, 4, 5, 19]
    sent = copy_in_place(src_k, src_v, dst_k, dst_v, slot_runs(src_slot_ids, dst_slot_ids))
    flat = (3, 20, 2, 8)
    for dst, src, before in ((dst_k, src_k, before_k), (dst_v, src_v, before_v)):
        assert torch.equal(dst.view(flat)[:, dst_slot_ids], src.view(flat)[:, src_slot_ids])
        untouched = [s for s in range(20) if s not in dst_slot_ids]
        assert torch.equal(dst.view(flat)[:, untouched], before.view(flat)[:, untouched])
    assert sent == layer_checksums(src_k, src_v, src_slot_ids) == layer_checksums(dst_k, dst_v, dst_slot_ids)


def test_a_corrupted_slot_changes_only_its_layer_checksum():
    src_k, src_v = _pools(torch.float32, 0)
    dst_k, dst_v = _pools(torch.float32, 1)
    slot_ids = [4, 5, 6, 7]
    sent = copy_in_place(src_k, src_v, dst_k, dst_v, slot_runs(slot_ids, slot_ids))
    dst_v.view(3, 20, 2, 8)[1, 6, 0, 0] += 1
    landed = layer_checksums(dst_k, dst_v, slot_ids)
    assert [a == b for a, b in zip(sent, landed)] == [True, False, True]


def test_checksums_of_layer_ranges_equal_the_whole():
    k, v = _pools(torch.float32, 2)
    slot_ids = [1, 2, 9, 10, 11]
    for ranges in ([range(0, 3)], [range(0, 1), range(1, 3)], [range(0, 1), range(1, 2), range(2, 3)]):
        assert [c for r in ranges for c in layer_checksums(k, v, slot_ids, r)] == layer_checksums(k, v, slot_ids)


def test_a_stopped_copy_raises():
    src_k, src_v = _pools(torch.float32, 0)
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError):
        copy_in_place(src_k, src_v, src_k.clone(), src_v.clone(), slot_runs([0], [1]), stop)
