"""A profile records the CPU kernel variant it was measured with; cpu_service refuses one measured
with another variant (its CPU latencies describe other code), naming both."""

from __future__ import annotations

import json

import pytest

from dualpace.model.config import ModelConfig
from dualpace.profile.daemon import load_daemon_profile
from dualpace.profile.files import parse_profile, profile_to_dict
from dualpace.profile.schema import ProfileError
from tests.profiles.tiny import tiny_profile_dict

CONFIG = ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=4)


def profile_file(tmp_path, variant: str | None, flags: list[str] | None = None):
    data = tiny_profile_dict()
    if variant is not None:
        data["hardware"]["cpu_kernel_variant"] = variant
    if flags is not None:
        data["hardware"]["cpu_flags"] = flags
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
