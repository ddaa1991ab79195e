"""Schema extensions (optional fingerprint fields, optional tables, profiler metadata),
CostModel.itl_ms (what the router asks) and the daemons' profile check."""

from __future__ import annotations

import json

import pytest

from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.profile.files import load_profile, parse_profile, profile_to_dict
from dualpace.profile.schema import (
    HardwareFingerprint,
    ModelFingerprint,
    ProfileError,
    fingerprint_mismatches,
)
from tests.profiles.tiny import tiny_profile_dict


def extended() -> dict:
    data = tiny_profile_dict()
    data["hardware"].update(cpu_threads=2, torch_version="2.13.0", device="cpu")
    data["model"]["config_hash"] = "abc123"
    data["tables"]["gpu_dense_ms"] = {"batch": [1, 11], "ms": [20.0, 21.0]}
    data["tables"]["assist_round_trip_ms"] = {"batch": [1, 11], "ms": [5.0, 4.0]}
    data["profiler"] = {"grids": {"batch": [1, 11]}, "duration_s": 1.5}
    return data


def test_old_files_still_parse_and_write_back_unchanged():
    profile = parse_profile(tiny_profile_dict())
    assert profile.hardware.cpu_threads is None and profile.model.config_hash is None
    assert profile.profiler is None and "gpu_dense_ms" not in profile.tables
    assert profile_to_dict(profile) == tiny_profile_dict()


def test_extended_fields_round_trip():
    profile = parse_profile(extended())
    assert profile.hardware.device == "cpu" and profile.model.config_hash == "abc123"
    assert profile.table1d("assist_round_trip_ms").ms == (5.0, 4.0)
    assert profile.profiler["duration_s"] == 1.5
    assert profile_to_dict(profile) == extended()


@pytest.mark.parametrize("section, key, value, message", [
    ("hardware", "cpu_threads", 0, "hardware.cpu_threads"),
    ("hardware", "device", "", "hardware.device"),
    ("model", "config_hash", 5, "model.config_hash"),
])
def test_bad_optional_fields_are_named(section, key, value, message):
    data = extended()
    data[section][key] = value
    with pytest.raises(ProfileError, match=message):
        parse_profile(data)


def test_bad_optional_table_is_named():
    data = extended()
    data["tables"]["gpu_dense_ms"]["ms"] = [1.0]
    with pytest.raises(ProfileError, match="tables.gpu_dense_ms.ms"):
        parse_profile(data)


def test_config_hash_compared_only_when_both_sides_have_one():
    profile = parse_profile(extended())
    same = ModelFingerprint(**extended()["model"])
    assert fingerprint_mismatches(profile, model=same) == []
    other = ModelFingerprint(**{**extended()["model"], "config_hash": "zzz"})
    assert fingerprint_mismatches(profile, model=other) == [
        "model.config_hash: profile has 'abc123', this deployment has 'zzz'"]
    unknown = ModelFingerprint(**{**extended()["model"], "config_hash": None})
    assert fingerprint_mismatches(profile, model=unknown) == []


def test_ignore_skips_named_fields():
    profile = parse_profile(extended())
    other = ModelFingerprint(**{**extended()["model"], "dtype": "fp32", "block_size": 8})
    assert len(fingerprint_mismatches(profile, model=other)) == 2
    assert fingerprint_mismatches(profile, model=other, ignore=("model.dtype", "model.block_size")) == []


def test_threads_and_device_compared_when_recorded():
    profile = parse_profile(extended())
    hw = extended()["hardware"]
    assert fingerprint_mismatches(profile, hardware=HardwareFingerprint(**hw)) == []
    assert fingerprint_mismatches(profile, hardware=HardwareFingerprint(**{**hw, "cpu_threads": 1})) == [
        "hardware.cpu_threads: profile has 2, this machine has 1"]
    unrecorded = {k: v for k, v in hw.items() if k not in ("cpu_threads", "torch_version", "device")}
    assert fingerprint_mismatches(profile, hardware=HardwareFingerprint(**unrecorded)) == []


# -- CostModel.itl_ms: the router's LatencyPredictor ---------------------------------------------


def test_itl_ms_per_engine_kind():
    cost = CostModel(parse_profile(tiny_profile_dict()))
    contexts = [50, 50]
    assert cost.itl_ms("gpu", contexts) == pytest.approx(cost.gpu_decode_ms(2, 50.0))
    best = cost.cpu_iteration(DecodeBatch(2, 50.0)).best_ms
    assert cost.itl_ms("cpu", contexts) == pytest.approx(best)
    assert cost.itl_ms("cpu", []) == 0.0
    with pytest.raises(ValueError):
        cost.itl_ms("tpu", contexts)


def test_itl_ms_without_assist_is_local():
    profile = parse_profile(tiny_profile_dict())
    contexts = [100] * 11  # tiny: local 40 + 20 + 5 = 65; assisted 25 + 20 = 45
    assert CostModel(profile).itl_ms("cpu", contexts) == pytest.approx(45.0)
    assert CostModel(profile, assist_available=False).itl_ms("cpu", contexts) == pytest.approx(65.0)


# -- dualpace.profile.daemon.load_daemon_profile ------------------------------------------------


@pytest.fixture
def tiny_config():
    from dualpace.model.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=4)


def write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_daemon_profile_matches_the_model(tmp_path, tiny_config):
    from dualpace.profile.daemon import load_daemon_profile
    from dualpace.profile.fingerprint import model_config_hash

    data = tiny_profile_dict()
    data["model"]["config_hash"] = model_config_hash(tiny_config)
    path = write(tmp_path, data)
    assert load_daemon_profile(str(path), tiny_config, "bfloat16", 4).model.block_size == 4
    assert load_daemon_profile(str(path), tiny_config).model.dtype == "bf16"  # router: dtype not compared
    with pytest.raises(ProfileError, match="model.dtype.*--profile-ignore-fingerprint"):
        load_daemon_profile(str(path), tiny_config, "float32", 4)
    assert load_daemon_profile(str(path), tiny_config, "float32", 4, ignore_fingerprint=True).model.dtype == "bf16"


def test_daemon_profile_other_model(tmp_path, tiny_config):
    from dataclasses import replace

    from dualpace.profile.daemon import load_daemon_profile

    path = write(tmp_path, tiny_profile_dict())
    bigger = replace(tiny_config, num_layers=4)
    with pytest.raises(ProfileError, match="made for another model.*model.num_layers"):
        load_daemon_profile(str(path), bigger, "bf16", 4)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=7), "version"),
    (lambda d: d["tables"].pop("assist_ms"), "tables.assist_ms: missing"),
])
def test_daemon_profile_bad_file(tmp_path, tiny_config, mutate, message):
    from dualpace.profile.daemon import load_daemon_profile

    data = tiny_profile_dict()
    mutate(data)
    with pytest.raises(ProfileError, match=f"--profile: profile .*{message}"):
        load_daemon_profile(str(write(tmp_path, data)), tiny_config, "bf16", 4)
    with pytest.raises(ProfileError, match="cannot read"):
        load_daemon_profile(str(tmp_path / "absent.json"), tiny_config)


def test_transfer_fit():
    from profiles.profiler.measure import fit_transfer

    rate, fixed = fit_transfer([(1_000_000, 3.0), (2_000_000, 4.0), (4_000_000, 6.0)])
    assert rate == pytest.approx(1e9) and fixed == pytest.approx(2.0)
    rate, fixed = fit_transfer([(1_000_000, 5.0), (2_000_000, 4.0)])  # noise: no upward trend
    assert rate == pytest.approx(5e8) and fixed == pytest.approx(4.0)


def test_stored_profile_loads(tmp_path):
    path = write(tmp_path, extended())
    assert load_profile(path).hardware.cpu_threads == 2
