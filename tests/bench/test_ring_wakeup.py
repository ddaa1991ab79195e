"""bench/ring_wakeup.py: two real processes exchange a few short layers through a real ring, each
variant gets its layers and every split is reported. No figure is asserted (docs/results.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dualpace.engine.assist.shm_doorbell import SUPPORTED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not SUPPORTED, reason="shared memory needs Linux x86-64")
def test_both_variants_run_and_every_split_is_reported(tmp_path):
    out = tmp_path / "wake.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-m", "bench.ring_wakeup", "--layers", "80", "--warmup", "0", "--block", "20",
                    "--layers-per-iteration", "10", "--cover-us", "300", "--attend-us", "20", "--post-us", "10",
                    "--variants", "spin:50,ahead:50", "--out", str(out)], check=True, cwd=ROOT, env=env, timeout=120)
    report = json.loads(out.read_text())
    for name in ("spin:50", "ahead:50"):
        assert report[name]["num_layers"] == 40
        assert {"down_hop", "down_hop_less_runqueue", "gpu_wait", "cpu_runqueue_in_wait"} <= set(report[name])
        assert report[name]["down_hop"]["p50_us"] > 0
