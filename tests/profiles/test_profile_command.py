"""`dualpace profile --quick` on a tiny synthetic model: a real gpu_service, the real runners,
a JSON the cost model loads, a PNG beside it, and reuse on the second run."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from dualpace.model.hf_loader import read_hf_config
from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.profile.files import load_profile
from dualpace.profile.fingerprint import model_config_hash
from dualpace.profile.schema import HardwareFingerprint
from dualpace_cli.main import main
from profiles.profiler.run import QUICK_GRIDS, reuse_problems


def test_quick_profile_is_written_loaded_and_reused(synth_checkpoint, tmp_path):
    model = synth_checkpoint("tiny-llama")
    out = tmp_path / "tiny.json"
    args = ["profile", "--model", str(model), "--quick", "--threads", "1", "--out", str(out), "--no-progress",
            "--notes", "test"]
    first = subprocess.run([sys.executable, "-m", "dualpace", *args], check=False, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"wrote {out}" in first.stdout

    profile = load_profile(out)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert profile.hardware.device == "cpu" and profile.hardware.cpu_threads == 1
    assert profile.hardware.torch_version
    assert profile.model.config_hash == model_config_hash(read_hf_config(model))
    from dualpace.model.loader import resolve_dtype
    from dualpace.profile.fingerprint import dtype_name

    auto = dtype_name(resolve_dtype("auto", "cpu"))  # bf16 where the CPU has native bf16, else fp32
    assert profile.model.dtype == auto and profile.notes == "test"
    assert profile.hardware.cpu_kernel_variant and profile.hardware.cpu_flags is not None
    assert profile.table1d("assist_ms").grid == (1.0, 4.0)
    assert profile.profiler["grids"]["batch"] == [1, 4] and profile.profiler["samples"]["assist"]
    cost = CostModel(profile)
    assert cost.cpu_local_ms(DecodeBatch(2, 40.0)) > 0 and cost.cpu_assisted_ms(DecodeBatch(2, 40.0)) > 0
    assert cost.kv_transfer_ms(64) > 0 and profile.capacities.cpu_kv_blocks > 0
    # Both data paths measured (the GPU engine runs on the CPU device here, so its pool is shared).
    assert set(profile.kv_transfer_paths) == {"shm", "tcp"} and profile.kv_transfer == profile.kv_transfer_paths["shm"]
    assert profile.table1d("assist_ms_tcp").grid == (1.0, 4.0)
    assert {name for name in profile.tables if name.startswith("assist_ms_")} == {"assist_ms_shm", "assist_ms_tcp"}
    assert profile.profiler["samples"]["assist_tcp"]
    assert profile.table1d("assist_ms_shm").ms == profile.table1d("assist_ms").ms
    assert set(profile.profiler["kv_transfer_fit_points_by_path"]) == {"shm", "tcp"}

    written = out.stat().st_mtime_ns
    # The second run in a fresh interpreter, as a user's: this process's kernel state (variants and
    # AMX toggled by earlier tests) is not the machine's fingerprint.
    second = subprocess.run([sys.executable, "-m", "dualpace", *args], check=False, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0 and "reusing the stored profile" in second.stdout, second.stdout + second.stderr
    assert out.stat().st_mtime_ns == written

    # Other grids, threads or model: measured again (checked without running the measurement).
    hardware = profile.hardware
    assert reuse_problems(profile, hardware, profile.model, QUICK_GRIDS) == []
    assert reuse_problems(profile, hardware, profile.model, replace(QUICK_GRIDS, repeats=3))
    assert reuse_problems(profile, replace(hardware, cpu_threads=2), profile.model, QUICK_GRIDS)
    assert reuse_problems(profile, hardware, replace(profile.model, config_hash="other"), QUICK_GRIDS)
    assert isinstance(hardware, HardwareFingerprint)


def test_bad_grid_is_a_one_line_error(capsys):
    assert main(["profile", "--batch", "4,2"]) == 2
    err = capsys.readouterr().err
    assert "--batch" in err and len(err.strip().splitlines()) == 1


def profile_on_smallest_grids(model, out) -> subprocess.CompletedProcess:
    """`dualpace profile` on the smallest grids, one thread; asserts it succeeded."""
    grids = ["--prefill-tokens", "16,32", "--batch", "1,2", "--context-tokens", "16,32", "--kv-transfer-tokens", "16,32",
             "--warmup", "0", "--repeats", "1"]
    run = subprocess.run([sys.executable, "-m", "dualpace", "profile", "--model", str(model), "--quick", *grids,
                          "--threads", "1", "--out", str(out), "--no-progress"], check=False, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def test_a_moe_profile_states_the_bytes_a_step_reads(synth_checkpoint, tmp_path):
    """A mixture-of-experts model's profile carries its weights' MoE bytes (what the cost model reads
    the CPU dense table along) and the run prints the active bytes per token. (On the smallest
    grids: what is checked here does not depend on them; the quick grids are checked above.)"""
    from dualpace.model.loader import load_model, moe_weight_bytes

    model = synth_checkpoint("tiny-mixtral")
    out = tmp_path / "moe.json"
    run = profile_on_smallest_grids(model, out)
    profile = load_profile(out)
    loaded = load_model(str(model), dtype=profile.model.dtype)
    assert profile.model.moe == moe_weight_bytes(loaded.model.weights, loaded.config)
    assert f"MoE {profile.model.moe.summary()}" in run.stdout
    assert CostModel(profile).cpu_local_ms(DecodeBatch(2, 40.0)) > 0


def test_a_model_that_moves_without_kv_costs_a_move_as_a_prefill(synth_checkpoint, tmp_path):
    """Gemma 3's sliding layers hold a KV pool of their own, which no transfer carries: its requests
    move without KV and the target recomputes them. Its profile measures no transfer (the engines
    decline one) and costs a move as the prefill of the same tokens, and says so."""
    model = synth_checkpoint("tiny-gemma3")
    out = tmp_path / "gemma3.json"
    profile_on_smallest_grids(model, out)
    profile = load_profile(out)
    assert "kv_transfer is a recompute (gpu_prefill_ms)" in profile.profiler["data_paths"]
    prefill = profile.table1d("gpu_prefill_ms")
    bytes_per_token = profile.model.kv_bytes_per_token
    assert [b for b, _ in profile.profiler["kv_transfer_fit_points"]] == [t * bytes_per_token for t in prefill.grid]
    assert [ms for _, ms in profile.profiler["kv_transfer_fit_points"]] == list(prefill.ms)
    assert not {"kv_transfer_shm", "kv_transfer_tcp"} & set(profile.profiler["samples"])
    assert not profile.kv_transfer_paths  # no transport measured
