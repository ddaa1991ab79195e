"""KV export/import copies (ModelRunner.read_kv / write_kv through dualpace.model.host_copies): on a
CPU pool the plain path, checked for correctness here; the pinned, side-stream path on CUDA is
checked by tests/model/test_cuda_fast_paths.py."""

from __future__ import annotations

import torch

from dualpace.engine.runner import ModelRunner
from dualpace.model.host_copies import HostCopies


def test_plain_path_on_cpu_gathers_and_converts():
    copies = HostCopies(torch.device("cpu"))
    assert not copies.staged
    cache = torch.arange(24, dtype=torch.float32).view(6, 2, 2)
    (rows,) = copies.gather_to_host([cache], torch.tensor([4, 0, 4]))
    assert torch.equal(rows, cache[[4, 0, 4]])
    rows[0] = -1  # a copy, not a view of the cache
    assert cache[4, 0, 0].item() == 16
    (converted,) = copies.to_device([torch.ones(2, 3)], torch.bfloat16)
    assert converted.dtype == torch.bfloat16 and converted.device.type == "cpu"


def kv_round_trip(runner: ModelRunner) -> None:
    """Rows written at scattered slots read back equal; every other slot stays zero."""
    kv = runner.kv
    slot_ids = [37, 2, 18, 19, 63]
    torch.manual_seed(0)
    k = torch.randn(len(slot_ids), kv.num_kv_heads, kv.head_dim)
    v = torch.randn_like(k)
    runner.write_kv(slot_ids, 1, k, v)
    k_back, v_back = runner.read_kv(slot_ids, 1)
    assert k_back.device.type == "cpu" and k_back.dtype == kv.dtype
    assert torch.equal(k_back, k.to(kv.dtype)) and torch.equal(v_back, v.to(kv.dtype))
    others = [s for s in range(kv.num_blocks * kv.block_size) if s not in slot_ids]
    k_rest, v_rest = runner.read_kv(others, 1)
    assert not k_rest.any() and not v_rest.any()
    assert not runner.read_kv(slot_ids, 0)[0].any()  # another layer untouched


def test_kv_export_import_round_trip_on_cpu(tiny):
    kv_round_trip(ModelRunner(tiny, num_blocks=8, block_size=8))
