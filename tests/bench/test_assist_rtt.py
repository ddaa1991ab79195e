"""bench/assist_rtt.py runs end to end on both transports (the tiny model's shapes, a few
iterations): every layer's round trip is measured, and the shm run really went through
shared memory (measure raises otherwise). No figure is asserted: speed is measured, never tested."""

from __future__ import annotations

import pytest

from bench.assist_rtt import measure
from dualpace.engine.assist.shm_doorbell import SUPPORTED


@pytest.mark.parametrize("transport", [pytest.param("shm", marks=pytest.mark.skipif(
    not SUPPORTED, reason="shared memory needs Linux x86-64")), "tcp"])
def test_measure_reports_every_layer_round_trip(synth_checkpoint, transport):
    result = measure(transport, batch_sizes=(1, 3), model=str(synth_checkpoint("tiny-llama")), dtype="fp32",
                     num_iterations=2, num_warmup=1)
    assert result["transport"] == transport and result["num_layers"] == 3
    for batch in ("1", "3"):
        row = result["batch"][batch]
        assert row["num_round_trips"] == 2 * (3 - 1)  # iterations x (layers - 1)
        assert 0 < row["p50_us"] <= row["p99_us"]
    assert result["cpu"] and result["load_average_1m"] >= 0
