"""bench.load.report.sweep_table shows the engines' preemptions when the rows carry them
(bench.compare_policies reads them from each engine's LoadSnapshot), and only then."""

from __future__ import annotations

from bench.load.report import sweep_table


def _row(**extra):
    return {"rate_rps": 2.0, "completed": 24, "failed": 0, "request_throughput_rps": 1.9,
            "output_token_throughput_tps": 120.0, "ttft_p50_ms": 150, "ttft_p99_ms": 400, "itl_p50_ms": 12.0,
            "itl_p99_ms": 90.0, "tpot_mean_ms": 14.0, "e2e_p99_ms": 2000, **extra}


def test_preemptions_column_only_when_rows_have_it():
    with_count = sweep_table({"gpu-only": [_row(num_preemptions=5)], "dualpace": [_row(num_preemptions=None)]})
    assert with_count.splitlines()[0].endswith("preemptions |")
    assert with_count.splitlines()[2].endswith("| 5 |") and with_count.splitlines()[3].endswith("| - |")
    assert "preemptions" not in sweep_table({"gpu-only": [_row()]})


def test_an_engine_that_does_not_answer_reports_no_count():
    from toolkit.engine_client import snapshot_preemptions

    assert snapshot_preemptions("127.0.0.1:1", timeout_s=2) is None
