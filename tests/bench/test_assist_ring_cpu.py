"""bench/assist_ring_cpu.py runs on the tiny model's shapes: the ring carries the tensors unchanged
(measure raises otherwise) and every piece is reported. No figure is asserted: speed lives in docs/perf.md."""

from __future__ import annotations

import pytest

from bench.assist_ring_cpu import measure
from dualpace.engine.assist.shm_doorbell import SUPPORTED


@pytest.mark.skipif(not SUPPORTED, reason="shared memory needs Linux x86-64")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_measure_reports_each_piece(synth_checkpoint, dtype):
    result = measure(batch=3, model=str(synth_checkpoint("tiny-llama")), dtype=dtype, repeats=20)
    assert set(result["cpu_us"]) == {"round_trip", "down_send_and_receive", "up_send_and_receive", "qkv_send_alone",
                                     "output_send_alone", "doorbell_post", "python_sum_range_1000"}
    assert all(us > 0 for us in result["cpu_us"].values())
    assert result["batch"] == 3 and result["cpu"]
