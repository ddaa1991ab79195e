"""cpu_service --profile and router --profile as real processes: a bad profile is refused
with one clear line, a good one is used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dualpace.model.hf_loader import read_hf_config
from dualpace.profile.fingerprint import model_fingerprint
from tests.profiles.tiny import tiny_profile_dict
from toolkit.processes import start_daemon

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model(synth_checkpoint):
    return synth_checkpoint("tiny-llama")


def profile_for(model, dtype="fp32") -> dict:
    """The tiny hand-made tables under the synthetic model's real fingerprint."""
    fingerprint = model_fingerprint(read_hf_config(model), dtype, BLOCK_SIZE)
    data = tiny_profile_dict()
    data["model"] = {k: v for k, v in vars(fingerprint).items()}
    data["capacities"]["bytes_per_block"] = fingerprint.kv_bytes_per_token * BLOCK_SIZE
    return data


def write(tmp_path, data, name) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def cpu_command(model, profile, *extra):
    return [sys.executable, "-m", "cpu_service", "--model", str(model), "--dtype", "fp32", "--threads", "1",
            "--assist", "never", "--profile", profile, "--listen", "127.0.0.1:0", *extra]


def refused(command) -> str:
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=90)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_cpu_service_refuses_a_bad_profile(model, tmp_path):
    """In one line, before serving. The file's own faults (version, a missing table) are refused by
    the same load_daemon_profile (tests/profiles/test_fingerprints_and_itl.py); the fingerprint
    needs the daemon's model."""
    data = profile_for(model, dtype="bf16")
    line = refused(cpu_command(model, write(tmp_path, data, "model.json")))
    assert line.startswith("cpu_service: error: --profile")
    assert ("made for another model (model.dtype: profile has 'bf16', this deployment has 'fp32'); "
            "pass --profile-ignore-fingerprint") in line


def test_cpu_service_uses_a_good_profile_and_router_too(model, tmp_path):
    good = write(tmp_path, profile_for(model), "good.json")
    cpu = start_daemon("cpu_service", "--model", str(model), "--dtype", "fp32", "--threads", "1",
                       "--assist", "never", "--profile", good)
    try:
        assert "mode choice seeded from profile" in cpu.log()
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**profile_for(model), "version": 0}))
        line = refused([sys.executable, "-m", "router", "serve", "--cpu", cpu.address, "--model", str(model),
                        "--profile", str(bad), "--listen", "127.0.0.1:0"])
        assert line.startswith("router: error: --profile") and "version" in line
        other = profile_for(model)
        other["model"]["num_layers"] += 1
        other["capacities"]["bytes_per_block"] = other["capacities"]["bytes_per_block"] // (
            other["model"]["num_layers"] - 1) * other["model"]["num_layers"]
        line = refused([sys.executable, "-m", "router", "serve", "--cpu", cpu.address, "--model", str(model),
                        "--profile", write(tmp_path, other, "other.json"), "--listen", "127.0.0.1:0"])
        assert "model.num_layers" in line and "--profile-ignore-fingerprint" in line
        router = start_daemon("router", "serve", "--cpu", cpu.address, "--model", str(model), "--profile", good,
                              "--itl-target-ms", "100")
        try:
            assert "profile loaded" in router.log()
        finally:
            assert router.stop() == 0, router.log()
    finally:
        assert cpu.stop() == 0, cpu.log()


def test_cpu_service_override_accepts_another_models_profile(model, tmp_path):
    data = profile_for(model, dtype="bf16")
    cpu = start_daemon("cpu_service", "--model", str(model), "--dtype", "fp32", "--threads", "1",
                       "--assist", "never", "--profile", write(tmp_path, data, "bf16.json"),
                       "--profile-ignore-fingerprint")
    try:
        assert "mode choice seeded" in cpu.log()
    finally:
        assert cpu.stop() == 0, cpu.log()
