import json

import pytest

from dualpace.profile.files import load_profile, parse_profile, profile_to_dict, save_profile
from dualpace.profile.schema import HardwareFingerprint, ModelFingerprint, ProfileError, check_fingerprints
from tests.profiles.tiny import tiny_profile_dict


def test_round_trip(tmp_path):
    profile = parse_profile(tiny_profile_dict())
    path = tmp_path / "p.json"
    save_profile(profile, path)
    again = load_profile(path)
    assert again == profile
    assert profile_to_dict(again) == tiny_profile_dict()
    assert profile.model.kv_bytes_per_token == 32


def test_wrong_version():
    data = tiny_profile_dict()
    data["version"] = 2
    with pytest.raises(ProfileError, match="version"):
        parse_profile(data)


@pytest.mark.parametrize("table", ["gpu_prefill_ms", "gpu_decode_ms", "cpu_dense_ms", "cpu_attention_ms",
                                   "assist_ms", "lm_head_sampling_ms"])
def test_missing_table_is_named(table):
    data = tiny_profile_dict()
    del data["tables"][table]
    with pytest.raises(ProfileError, match=f"tables.{table}: missing"):
        parse_profile(data)


def test_missing_sections_are_named():
    for key in ("hardware", "model", "kv_transfer", "capacities"):
        data = tiny_profile_dict()
        del data[key]
        with pytest.raises(ProfileError, match=key):
            parse_profile(data)


def test_non_monotonic_grid():
    data = tiny_profile_dict()
    data["tables"]["cpu_dense_ms"] = {"batch": [1, 8, 4], "ms": [1.0, 2.0, 3.0]}
    with pytest.raises(ProfileError, match=r"tables.cpu_dense_ms.batch: grid must be strictly increasing"):
        parse_profile(data)
    data = tiny_profile_dict()
    data["tables"]["gpu_decode_ms"]["context_tokens"] = [100, 100]
    with pytest.raises(ProfileError, match="context_tokens: grid must be strictly increasing"):
        parse_profile(data)


def test_shape_and_value_errors():
    data = tiny_profile_dict()
    data["tables"]["assist_ms"]["ms"] = [1.0]
    with pytest.raises(ProfileError, match="assist_ms.ms: has 1 values"):
        parse_profile(data)
    data = tiny_profile_dict()
    data["tables"]["gpu_decode_ms"]["ms"][1] = [1.0, -2.0]
    with pytest.raises(ProfileError, match=r"gpu_decode_ms.ms\[1\]\[1\]"):
        parse_profile(data)
    data = tiny_profile_dict()
    data["capacities"]["bytes_per_block"] = 100
    with pytest.raises(ProfileError, match="bytes_per_block"):
        parse_profile(data)
    data = tiny_profile_dict()
    data["kv_transfer"]["bytes_per_s"] = 0
    with pytest.raises(ProfileError, match="kv_transfer.bytes_per_s"):
        parse_profile(data)


def test_unreadable_and_bad_json(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


def test_fingerprint_mismatch(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(tiny_profile_dict()))
    model = ModelFingerprint(**{**tiny_profile_dict()["model"], "num_layers": 3})
    with pytest.raises(ProfileError, match=r"model.num_layers: profile has 2, this deployment has 3"):
        load_profile(path, model=model)
    profile = load_profile(path, model=model, allow_mismatch=True)
    assert profile.model.num_layers == 2

    hardware = HardwareFingerprint(**{**tiny_profile_dict()["hardware"], "gpu_model": "Other GPU"})
    with pytest.raises(ProfileError, match="hardware.gpu_model"):
        check_fingerprints(profile, hardware=hardware)
    assert check_fingerprints(profile, hardware=hardware, allow_mismatch=True)
    # memory sizes within 5% and a different bandwidth measurement are the same machine
    same = HardwareFingerprint(**{**tiny_profile_dict()["hardware"], "memory_bytes": int(8 * 2**30 * 0.98),
                                  "memory_bandwidth_bytes_per_s": 2e10})
    assert check_fingerprints(profile, hardware=same) == []


def test_reference_profile_loads_and_matches_llama3_8b():
    from dualpace.profile.cost_model import CostModel, DecodeBatch

    profile = load_profile("profiles/reference/h100_sapphire_rapids_llama3_8b.json")
    assert profile.model.kv_bytes_per_token == 128 * 1024
    assert profile.capacities.bytes_per_block == 16 * 128 * 1024
    cost = CostModel(profile)
    assert 5.0 < cost.gpu_iteration_ms(0, DecodeBatch(1, 1024)) < 9.0  # ~15 GB of weights at ~2.7 TB/s
    assert cost.cpu_iteration(DecodeBatch(1, 1024)).assisted_is_faster
