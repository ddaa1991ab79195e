"""Round trips and malformed-message errors of dualpace.wire.common and dualpace.wire.tensors."""

from __future__ import annotations

import pytest
import torch

from dualpace.errors import InvalidArgument
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire import common, tensors
from dualpace.wire.v1 import common_pb2

# ---- sampling parameters -------------------------------------------------


def _through_the_wire(params: SamplingParams) -> SamplingParams:
    message = common.sampling_params_to_pb(params)
    decoded = common_pb2.SamplingParams.FromString(message.SerializeToString())
    return common.sampling_params_from_pb(decoded)


def test_sampling_params_round_trip_all_fields() -> None:
    params = SamplingParams(
        max_tokens=77,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=2**63 - 1,
        stop=("\n\n", "END"),
        stop_token_ids=(2, 49151),
        ignore_eos=True,
    )
    assert _through_the_wire(params) == params


def test_a_guided_spec_travels_with_the_sampling_params() -> None:
    from dualpace.guided_spec import GuidedKind, GuidedSpec

    for kind in GuidedKind:
        params = SamplingParams(guided=GuidedSpec(kind, '{"type": "object"}', num_output_tokens_in_prompt=7))
        assert _through_the_wire(params) == params
    assert not common.sampling_params_to_pb(SamplingParams()).HasField("guided")
    unset_kind = common.sampling_params_to_pb(SamplingParams())
    unset_kind.guided.spec = "x"
    with pytest.raises(ValueError, match="guided.kind"):
        common.sampling_params_from_pb(unset_kind)


def test_sampling_params_round_trip_defaults() -> None:
    assert _through_the_wire(SamplingParams()) == SamplingParams()


def test_seed_presence_is_kept() -> None:
    unseeded = common.sampling_params_to_pb(SamplingParams(seed=None))
    assert not unseeded.HasField("seed")
    assert common.sampling_params_from_pb(unseeded).seed is None

    zero_seed = common.sampling_params_to_pb(SamplingParams(seed=0))
    assert zero_seed.HasField("seed")
    assert common.sampling_params_from_pb(zero_seed).seed == 0


def test_empty_message_gives_core_defaults() -> None:
    params = common.sampling_params_from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams()
    assert params.validate() is params


def test_explicit_zero_max_tokens_is_kept_and_rejected_by_validate() -> None:
    params = common.sampling_params_from_pb(common_pb2.SamplingParams(max_tokens=0))
    assert params.max_tokens == 0
    with pytest.raises(InvalidArgument, match="max_tokens"):
        params.validate()


# ---- finish reason --------------------------------------------------------


@pytest.mark.parametrize("reason", [None, *FinishReason])
def test_finish_reason_round_trip(reason: FinishReason | None) -> None:
    assert common.finish_reason_from_pb(common.finish_reason_to_pb(reason)) == reason


def test_finish_reason_names_match() -> None:
    for reason in FinishReason:
        assert common_pb2.FinishReason.Name(common.finish_reason_to_pb(reason)) == f"FINISH_REASON_{reason.name}"


def test_unknown_finish_reason_value() -> None:
    with pytest.raises(ValueError, match="finish_reason: unknown enum value 99"):
        common.finish_reason_from_pb(99)


# ---- token ids ------------------------------------------------------------


def test_token_ids_round_trip_from_list_and_tensor() -> None:
    ids = [0, 1, 49151, 2**32 - 1]
    assert common.token_ids_from_pb(common.token_ids_to_pb(ids)) == ids
    tensor_ids = torch.tensor([5, 6, 7], dtype=torch.int64)
    assert common.token_ids_from_pb(common.token_ids_to_pb(tensor_ids)) == [5, 6, 7]


def test_token_ids_from_repeated_field() -> None:
    message = common_pb2.TokenIds(token_ids=[3, 1, 4])
    assert common.token_ids_from_pb(message.token_ids) == [3, 1, 4]


def test_token_ids_out_of_range() -> None:
    with pytest.raises(ValueError, match="token id -1"):
        common.token_ids_to_list([1, -1])
    with pytest.raises(ValueError, match="prompt_token_ids: token id 4294967296"):
        common.token_ids_to_list([2**32], field="prompt_token_ids")


def test_token_ids_rejects_float_or_2d_tensor() -> None:
    with pytest.raises(ValueError, match="1-D integer tensor"):
        common.token_ids_to_list(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        common.token_ids_to_list(torch.zeros(2, 2, dtype=torch.int64))


# ---- tensors --------------------------------------------------------------


def _tensor_through_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    message = tensors.tensor_to_pb(tensor)
    return tensors.tensor_from_pb(common_pb2.Tensor.FromString(message.SerializeToString()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 3, 5)])
def test_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(shape, generator=generator).to(dtype)
    decoded = _tensor_through_the_wire(tensor)
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_bfloat16_is_bit_exact_including_special_values() -> None:
    bits = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80, 0xC2F7], dtype=torch.int32)
    tensor = bits.to(torch.int16).view(torch.bfloat16)  # +0, -0, +inf, -inf, NaN payload, subnormal, 1, -123.5
    decoded = _tensor_through_the_wire(tensor)
    assert torch.equal(decoded.view(torch.int16), tensor.view(torch.int16))


def test_tensor_bytes_are_little_endian_c_order() -> None:
    tensor = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    message = tensors.tensor_to_pb(tensor.t())  # a non-contiguous view is serialized in C order
    assert message.dtype == "float32"
    assert list(message.shape) == [2, 2]
    assert message.data[:4] == b"\x00\x00\x80\x3f"  # 1.0
    assert message.data[4:8] == b"\x00\x00\x40\x40"  # 3.0: row 0 of the transpose


def test_decoded_tensor_owns_writable_memory() -> None:
    message = tensors.tensor_to_pb(torch.ones(4))
    decoded = tensors.tensor_from_pb(message)
    decoded += 1
    assert torch.equal(decoded, torch.full((4,), 2.0))
    assert tensors.tensor_from_pb(message).sum().item() == 4.0


def test_tensor_from_pb_expected_shape() -> None:
    message = tensors.tensor_to_pb(torch.zeros(2, 6))
    assert tensors.tensor_from_pb(message, expected_shape=(2, 6)).shape == (2, 6)
    with pytest.raises(ValueError, match=r"attention_output: shape \[2, 6\] does not match the expected \[2, 8\]"):
        tensors.tensor_from_pb(message, field="attention_output", expected_shape=(2, 8))


def test_tensor_data_length_mismatch() -> None:
    message = common_pb2.Tensor(dtype="bfloat16", shape=[2, 3], data=b"\x00" * 10)
    with pytest.raises(ValueError, match=r"q: data is 10 bytes but shape \[2, 3\] of bfloat16 needs 12 bytes"):
        tensors.tensor_from_pb(message, field="q")


def test_tensor_unknown_dtype() -> None:
    message = common_pb2.Tensor(dtype="int8", shape=[4], data=b"\x00" * 4)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        tensors.tensor_from_pb(message)
    with pytest.raises(ValueError, match="unknown dtype ''"):
        tensors.tensor_from_pb(common_pb2.Tensor())


def test_tensor_negative_dimension() -> None:
    message = common_pb2.Tensor(dtype="float32", shape=[-1, 4], data=b"")
    with pytest.raises(ValueError, match="negative dimension"):
        tensors.tensor_from_pb(message)


def test_unsupported_torch_dtype() -> None:
    with pytest.raises(ValueError, match="not supported"):
        tensors.tensor_to_pb(torch.zeros(3, dtype=torch.float64))


def test_load_snapshot_carries_the_engines_preemptions_to_the_routers_view():
    from dualpace.engine.load import EngineLoad
    from dualpace.wire.engine_messages import engine_view_from_pb, load_to_pb
    from dualpace.wire.v1 import engine_pb2

    load = EngineLoad(name="gpu0", kind="gpu", serving=True, num_running=3, num_waiting=1, kv_blocks_total=64,
                      kv_blocks_used=60, block_size=16, itl_p50_ms=12.0, itl_p99_ms=40.0, num_iterations=900,
                      num_preemptions=7, timestamp_unix_ms=1, kv_blocks_cached=2)
    wire = engine_pb2.LoadSnapshot.FromString(load_to_pb(load).SerializeToString())
    assert wire.num_preemptions == 7
    view = engine_view_from_pb(wire, "gpu")
    assert view.num_preemptions == 7 and view.kv_blocks_used == 60
    assert engine_view_from_pb(engine_pb2.LoadSnapshot(engine="old"), "cpu").num_preemptions == 0  # field absent
