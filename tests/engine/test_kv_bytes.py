from dualpace.engine.transfer.kv_bytes import DTYPES_BY_NAME, tensor_bytes, tensor_from_bytes
from dualpace.engine.transfer.kv_transfer import ITEMSIZE_BYTES


def test_torch_free_item_sizes_match_torch():
    assert {name: dtype.itemsize for name, dtype in DTYPES_BY_NAME.items()} == ITEMSIZE_BYTES


def test_bytes_round_trip_every_kv_dtype():
    import torch

    for name, dtype in DTYPES_BY_NAME.items():
        tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
        assert torch.equal(tensor_from_bytes(tensor_bytes(tensor), name, (2, 3)), tensor)
