"""A profile records the CPU kernel variant it was measured with and whether it ran AMX tiles;
cpu_service refuses one measured with another variant, or with AMX tiles on where its kernels run
none (or the reverse), since its CPU latencies describe other code, naming the difference."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dualpace.model import cpu_kernels
from dualpace.model import cpu_kernels_build as kbuild
from dualpace.model.config import ModelConfig
from dualpace.profile.daemon import load_daemon_profile
from dualpace.profile.files import parse_profile, profile_to_dict
from dualpace.profile.schema import ProfileError, fingerprint_mismatches
from profiles.profiler.hardware import hardware_fingerprint
from tests.profiles.tiny import tiny_profile_dict

CONFIG = ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=4)


def profile_file(tmp_path, variant: str | None, flags: list[str] | None = None, amx: bool | None = None):
    data = tiny_profile_dict()
    if variant is not None:
        data["hardware"]["cpu_kernel_variant"] = variant
    if flags is not None:
        data["hardware"]["cpu_flags"] = flags
    if amx is not None:
        data["hardware"]["cpu_amx"] = amx
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_variant_and_flags_round_trip(tmp_path):
    profile = parse_profile(json.loads(open(profile_file(tmp_path, "avx2", ["avx2", "f16c", "fma"])).read()))
    assert profile.hardware.cpu_kernel_variant == "avx2"
    assert profile.hardware.cpu_flags == ("avx2", "f16c", "fma")
    again = profile_to_dict(profile)["hardware"]
    assert again["cpu_kernel_variant"] == "avx2" and list(again["cpu_flags"]) == ["avx2", "f16c", "fma"]


def test_other_variant_refused_naming_both(tmp_path):
    path = profile_file(tmp_path, "avx512_bf16")
    with pytest.raises(ProfileError, match="'avx512_bf16'.*'avx2'.*--profile-ignore-fingerprint"):
        load_daemon_profile(path, CONFIG, cpu_kernel_variant="avx2")
    assert load_daemon_profile(path, CONFIG, cpu_kernel_variant="avx2", ignore_fingerprint=True)


def test_same_or_unrecorded_variant_accepted(tmp_path):
    assert load_daemon_profile(profile_file(tmp_path, "avx2"), CONFIG, cpu_kernel_variant="avx2")
    assert load_daemon_profile(profile_file(tmp_path, None), CONFIG, cpu_kernel_variant="avx2")  # an older profile
    assert load_daemon_profile(profile_file(tmp_path, "avx2"), CONFIG)  # the router: no CPU kernels of its own


def test_bad_flags_named(tmp_path):
    with pytest.raises(ProfileError, match="hardware.cpu_flags"):
        parse_profile(json.loads(open(profile_file(tmp_path, "avx2", "avx2")).read()))


def test_amx_recorded_and_round_trips(tmp_path):
    profile = parse_profile(json.loads(open(profile_file(tmp_path, "avx512_bf16", ["amx_bf16"], amx=True)).read()))
    assert profile.hardware.cpu_amx is True
    assert profile_to_dict(profile)["hardware"]["cpu_amx"] is True
    assert parse_profile(tiny_profile_dict()).hardware.cpu_amx is None  # an older profile: unknown
    other = dataclasses.replace(profile.hardware, cpu_amx=False)  # the profiler measures again
    assert any(p.startswith("hardware.cpu_amx") for p in fingerprint_mismatches(profile, hardware=other))
    with pytest.raises(ProfileError, match="hardware.cpu_amx"):
        parse_profile(json.loads(open(profile_file(tmp_path, "avx512_bf16", amx="yes")).read()))


def test_profile_measured_with_amx_refused_without(tmp_path):
    path = profile_file(tmp_path, "avx512_bf16", amx=True)
    with pytest.raises(ProfileError, match="AMX tiles on, this engine's CPU kernels run without them") as error:
        load_daemon_profile(path, CONFIG, cpu_kernel_variant="avx512_bf16", cpu_amx=False)
    assert "\n" not in str(error.value)
    assert load_daemon_profile(path, CONFIG, cpu_kernel_variant="avx512_bf16", cpu_amx=False, ignore_fingerprint=True)
    with pytest.raises(ProfileError, match="no AMX tiles, this engine's CPU kernels run them"):
        load_daemon_profile(profile_file(tmp_path, "avx512_bf16", amx=False), CONFIG,
                            cpu_kernel_variant="avx512_bf16", cpu_amx=True)


def test_same_or_unrecorded_amx_accepted(tmp_path):
    assert load_daemon_profile(profile_file(tmp_path, "avx512_bf16", amx=True), CONFIG,
                               cpu_kernel_variant="avx512_bf16", cpu_amx=True)
    assert load_daemon_profile(profile_file(tmp_path, "avx512_bf16"), CONFIG,  # recorded before the field
                               cpu_kernel_variant="avx512_bf16", cpu_amx=False)


class FakeKernels:
    variant, amx = "avx512_bf16", True


def test_the_profiler_records_amx_flags_and_use(monkeypatch):
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: frozenset({"avx2", "fma", "amx_tile", "amx_bf16", "sse2"}))
    monkeypatch.setattr(cpu_kernels, "get", lambda: FakeKernels())
    assert cpu_kernels.kernel_info() == {"variant": "avx512_bf16", "cpu_flags": ["amx_bf16", "amx_tile", "avx2", "fma"],
                                         "amx": True}
    hardware = hardware_fingerprint(threads=1, device="cpu")
    assert hardware.cpu_amx is True and "amx_bf16" in hardware.cpu_flags
    monkeypatch.setattr(cpu_kernels, "get", lambda: None)
    assert cpu_kernels.kernel_info()["amx"] is False
