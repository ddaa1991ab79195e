"""bench/cooperative_timeline.py on synthetic step records: a clean gated run passes both points,
and each way a run can break them (a local decode, a join the GPU step does not list, a GPU
step missing, one join claimed twice, one peer for two CPU engines, a held GPU, no attention
times) fails with its reason; the command's exit status follows."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cooperative_timeline import check_files, check_timelines, format_report, main, timeline_paths
from dualpace.engine.step_timeline import JoinedRows, StepRecord, StepTimeline

MS = 1_000_000


def gpu_step(step_id: int, joins=(), own_rows: int = 2, wait_ms: float = 0.0) -> StepRecord:
    start = step_id * 100 * MS
    return StepRecord("gpu", step_id, start, start + 40 * MS, "gpu", own_rows,
                      tuple(JoinedRows(peer, iteration, 1) for peer, iteration in joins),
                      "JOINED" if joins else "", int(wait_ms * MS))


def cpu_iteration(step_id: int, iteration_id: int | None, gpu_step_id: int | None, mode: str = "cooperative",
                  engine: str = "cpu", attention_ms: float = 10.0, prefill_rows: int = 0) -> StepRecord:
    start = (gpu_step_id or step_id) * 100 * MS - 2 * MS
    cooperative = mode == "cooperative"
    return StepRecord(engine, step_id, start, start + 45 * MS, mode, 1, how="JOINED" if cooperative else "",
                      num_prefill_rows=prefill_rows, iteration_id=iteration_id if cooperative else None,
                      engine_step_id=gpu_step_id if cooperative else None, attention_ns=int(attention_ms * MS))


def clean_run(num_steps: int = 4):
    gpu = [gpu_step(s, [("stream-1", s)], wait_ms=0.2) for s in range(1, num_steps + 1)]
    cpu = [cpu_iteration(0, None, None, mode="local", prefill_rows=1)]  # a local prefill: not a decode
    cpu += [cpu_iteration(s, s, s) for s in range(1, num_steps + 1)]
    return gpu, cpu


def test_a_clean_gated_run_passes_and_reports_intervals():
    gpu, cpu = clean_run()
    check = check_timelines(gpu + [gpu_step(9)], cpu)
    assert check.passed, format_report(check)
    summary = check.summary()
    assert summary["num_cpu_matched"] == 4 and summary["num_unclaimed_joins"] == 0
    assert summary["gpu_wait_share"] == pytest.approx(0.02)
    assert summary["gpu_step_ms"] == 160.0  # four 40 ms GPU steps
    assert summary["gpu_wait_share_of_steps"] == pytest.approx(0.8 / 160)
    assert "0.50% of those GPU steps' 160.0 ms" in format_report(check)
    assert summary["join_wait"]["p50_ms"] == 2.0  # CPU iteration began 2 ms before its GPU step
    assert summary["tail_after_gpu_step"]["max_ms"] == 3.0
    assert summary["cpu_decode_iterations_by_mode"] == {"cooperative": 4}


@pytest.mark.parametrize("break_it, reason", [
    (lambda gpu, cpu: cpu.append(cpu_iteration(7, None, None, mode="local")), "ran local"),
    (lambda gpu, cpu: cpu.append(cpu_iteration(8, None, None, mode="assisted")), "ran assisted"),
    (lambda gpu, cpu: cpu.append(cpu_iteration(7, 77, 2)), "iteration 77 is not among GPU step 2's joins"),
    (lambda gpu, cpu: cpu.append(cpu_iteration(7, 5, 55)), "GPU step 55 is not in the GPU timeline"),
    (lambda gpu, cpu: cpu.append(cpu_iteration(7, 3, 3)), "already claimed"),
    (lambda gpu, cpu: cpu.append(StepRecord("cpu", 7, 0, 1, "cooperative", 1)), "without a GPU step id"),
    (lambda gpu, cpu: gpu.extend([gpu_step(1), gpu_step(1)]), "GPU step 1 recorded 3 times"),
])
def test_each_break_of_point_one_fails_with_its_reason(break_it, reason):
    gpu, cpu = clean_run()
    break_it(gpu, cpu)
    check = check_timelines(gpu, cpu)
    assert not check.advance_only_inside_gpu and not check.passed
    assert any(reason in line for line in check.failures), check.failures
    assert reason in format_report(check)


def test_one_peer_cannot_stand_for_two_cpu_engines():
    gpu = [gpu_step(1, [("stream-1", 1)]), gpu_step(2, [("stream-1", 2)])]
    cpu = [cpu_iteration(1, 1, 1, engine="cpu-a"), cpu_iteration(1, 2, 2, engine="cpu-b")]
    check = check_timelines(gpu, cpu)
    assert check.num_cpu_matched == 1
    assert any("cpu-b" in line and "not among" in line for line in check.failures)
    # With its own stream the second CPU engine is matched.
    gpu[1] = gpu_step(2, [("stream-2", 2)])
    assert check_timelines(gpu, cpu).advance_only_inside_gpu


def test_dualpace_allows_local_and_staged_iterations_but_checks_cooperative_ones():
    gpu, cpu = clean_run()
    cpu += [cpu_iteration(7, None, None, mode="local"), cpu_iteration(8, None, None, mode="assisted")]
    check = check_timelines(gpu, cpu, policy="dualpace")
    assert check.passed and check.num_cpu_checked == 4
    assert check.summary()["cpu_decode_iterations_by_mode"] == {"assisted": 1, "cooperative": 4, "local": 1}
    cpu.append(cpu_iteration(9, 99, 1))
    assert not check_timelines(gpu, cpu, policy="dualpace").passed


def test_no_cooperative_iteration_at_all_is_not_a_pass():
    check = check_timelines([gpu_step(1)], [cpu_iteration(0, None, None, mode="local", prefill_rows=2)])
    assert not check.advance_only_inside_gpu and check.num_cpu_checked == 0


def test_a_gpu_held_through_the_cpu_attention_fails_point_two():
    gpu = [gpu_step(s, [("stream-1", s)], wait_ms=10.0) for s in (1, 2)]  # waited the whole attention
    cpu = [cpu_iteration(s, s, s) for s in (1, 2)]
    check = check_timelines(gpu, cpu)
    assert check.advance_only_inside_gpu and not check.gpu_not_idle
    assert check.wait_share == pytest.approx(1.0)
    assert "100.00%" in format_report(check)


def test_share_counts_only_steps_with_own_rows_and_needs_attention_times():
    alone = [gpu_step(1, [("stream-1", 1)], own_rows=0, wait_ms=10.0), gpu_step(2, [("stream-1", 2)], wait_ms=0.1)]
    cpu = [cpu_iteration(1, 1, 1), cpu_iteration(2, 2, 2)]
    assert check_timelines(alone, cpu).wait_share == pytest.approx(0.01)  # step 1 had nothing to overlap
    split = StepRecord("gpu", 3, 0, 1, "gpu", 2, (JoinedRows("stream-1", 3, 1),), "SPLIT", 5 * MS, 2)
    by_how = check_timelines([*alone, split], [*cpu, cpu_iteration(3, 3, 3)]).summary()["gpu_wait_share_by_how"]
    assert by_how == {"JOINED": pytest.approx(0.01), "SPLIT": pytest.approx(0.5)}
    unmeasured = check_timelines(alone, [cpu_iteration(2, 2, 2, attention_ms=0)])
    assert unmeasured.wait_share is None and not unmeasured.passed
    assert "not measured" in format_report(unmeasured)


def test_unclaimed_joins_are_counted():
    gpu, cpu = clean_run()
    gpu.append(gpu_step(5, [("stream-1", 5)]))
    check = check_timelines(gpu, cpu)
    assert check.passed and check.num_unclaimed_joins == 1


def write(path, records):
    timeline = StepTimeline(str(path))
    for record in records:
        timeline.append(record)
    timeline.close()
    return str(path)


def test_command_exit_status(tmp_path, capsys):
    gpu, cpu = clean_run()
    gpu_file, cpu_file = write(tmp_path / "gpu.jsonl", gpu), write(tmp_path / "cpu.jsonl", cpu)
    summary = tmp_path / "summary.json"
    assert main(["--gpu", gpu_file, "--cpu", cpu_file, "--json", str(summary)]) == 0
    assert '"passed": true' in summary.read_text()
    local_file = write(tmp_path / "local.jsonl", [*cpu, cpu_iteration(9, None, None, mode="local")])
    assert main(["--gpu", gpu_file, "--cpu", local_file]) == 1
    assert "FAIL" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text("{oops\n{}\n")
    assert main(["--gpu", gpu_file, "--cpu", str(tmp_path / "bad.jsonl")]) == 2
    assert main(["--gpu", str(tmp_path / "absent.jsonl"), "--cpu", cpu_file]) == 2
    assert "error" in capsys.readouterr().err


def test_bench_paths_are_cleared_and_checked(tmp_path):
    directory = str(tmp_path / "timelines")
    paths = timeline_paths(directory, "gated", clear=True)
    assert sorted(paths) == ["cpu", "gpu"] and paths["gpu"].endswith("gated_gpu.jsonl")
    assert "unreadable" in check_files(paths, "gated")["report"]  # the engines wrote nothing
    gpu, cpu = clean_run()
    write(paths["gpu"], gpu)
    write(paths["cpu"], cpu)
    assert check_files(paths, "gated")["passed"]
    write(paths["cpu"], cpu)  # an engine appends: the same records twice
    assert not check_files(paths, "gated")["passed"]
    assert timeline_paths(directory, "gated", clear=True) == paths
    assert not any(Path(p).exists() for p in paths.values())


def test_the_wait_splits_into_uncovered_attention_and_transport():
    """Step 1: attention 10 ms, cover 7 ms, wait 5 ms -> 3 ms the GPU's own work could not hide,
    2 ms transport and scheduling. Step 2: cover 12 ms hides it all; its 1 ms wait is transport."""
    from dataclasses import replace

    gpu = [replace(gpu_step(1, [("stream-1", 1)], wait_ms=5.0), cover_ns=7 * MS),
           replace(gpu_step(2, [("stream-1", 2)], wait_ms=1.0), cover_ns=12 * MS)]
    cpu = [cpu_iteration(1, 1, 1), cpu_iteration(2, 2, 2)]
    summary = check_timelines(gpu, cpu).summary()
    assert summary["cover_ms"] == 19.0
    assert summary["gpu_wait_uncovered_ms"] == 3.0 and summary["gpu_wait_transport_ms"] == 3.0
    assert "3.0 ms attention longer than the GPU's own overlapping work" in format_report(check_timelines(gpu, cpu))


def test_the_layer_stamps_are_summed_over_the_counted_steps_and_reported_per_layer():
    """Two steps of 30 stamped layers each (the GPU records' LayerMarks fields); a step of remote
    rows alone is not counted, as for the wait."""
    from dataclasses import replace

    def stamped(step, own_rows=2):
        return replace(gpu_step(step, [("stream-1", step)], own_rows=own_rows, wait_ms=1.0), num_marked_layers=30,
                       down_hop_ns=3 * MS, cpu_layer_ns=6 * MS, wait_before_answer_ns=int(0.6 * MS),
                       up_hop_ns=int(0.3 * MS), num_wait_sleeps=3, num_long_waits=1, long_wait_ns=2 * MS,
                       runqueue_delay_ns=MS)

    gpu = [stamped(1), stamped(2), stamped(3, own_rows=0)]
    cpu = [replace(cpu_iteration(s, s, s), runqueue_delay_ns=3 * MS) for s in (1, 2, 3)]
    check = check_timelines(gpu, cpu)
    assert check.summary()["layer_marks"] == {"num_layers": 60, "down_hop_us": 100.0, "cpu_layer_us": 200.0,
                                              "wait_before_answer_us": 20.0, "up_hop_us": 10.0,
                                              "sleeps_per_layer": 0.1, "num_long_waits": 2, "long_wait_ms": 4.0,
                                              "gpu_runqueue_ms": 2.0, "cpu_runqueue_ms": 6.0}
    report = format_report(check)
    assert "q/k/v -> CPU 100.0 us" in report and "slept 10%" in report and "CPU iterations 6.0 ms" in report
    assert check_timelines(*clean_run()).summary()["layer_marks"] == {"num_layers": 0}
