"""Step timelines: records round-trip through the JSON-lines file, the ring and the writer's
queue stay bounded, bad records and bad files are clear errors, and the daemon flag refuses
an unwritable path before loading anything."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from dualpace.engine.step_timeline import JoinedRows, StepRecord, StepTimeline, assisted_record_fields, read_timeline
from dualpace.errors import InvalidArgument


def gpu_record(step_id: int, joins=(), **extra) -> StepRecord:
    return StepRecord(engine="gpu", step_id=step_id, start_ns=1000 * step_id, end_ns=1000 * step_id + 900,
                      mode="gpu", num_own_rows=2, joins=tuple(joins), how="JOINED" if joins else "", **extra)


def test_records_round_trip_through_the_file(tmp_path):
    path = tmp_path / "gpu.jsonl"
    timeline = StepTimeline(str(path))
    written = [gpu_record(1), gpu_record(2, [JoinedRows("cpu-stream-1", 7, 3)], gpu_wait_ns=50, num_weight_passes=1)]
    for record in written:
        timeline.append(record)
    cpu = timeline.record_step(engine="cpu", step_id=4, start_ns=1900, end_ns=3100, mode="cooperative",
                               num_own_rows=3, how="JOINED", iteration_id=7, engine_step_id=2,
                               engine_step_start_ns=2000, engine_step_end_ns=2900, attention_ns=400)
    timeline.close()
    timeline.close()  # idempotent
    assert read_timeline(path) == [*written, cpu]
    assert timeline.records() == [*written, cpu]
    timeline.append(gpu_record(9))  # after close: kept in memory, not written
    assert len(read_timeline(path)) == 3


def test_ring_keeps_the_newest_and_pending_is_bounded(tmp_path):
    in_memory = StepTimeline(ring_records=3)
    for step_id in range(1, 8):
        in_memory.append(gpu_record(step_id))
    assert [r.step_id for r in in_memory.records()] == [5, 6, 7]
    in_memory.close()

    bounded = StepTimeline(str(tmp_path / "t.jsonl"), max_pending_records=2)
    with bounded._wake:  # the writer cannot take anything meanwhile: it needs this lock
        for step_id in range(1, 6):
            bounded.append(gpu_record(step_id))
    bounded.close()
    assert bounded.num_dropped == 3
    assert [r.step_id for r in read_timeline(tmp_path / "t.jsonl")] == [4, 5]


@pytest.mark.parametrize("change, field", [
    ({"mode": "turbo"}, "mode"),
    ({"how": "sideways"}, "how"),
    ({"end_ns": 10}, "end_ns"),
    ({"gpu_wait_ns": -1}, "gpu_wait_ns"),
])
def test_bad_records_name_the_field(change, field):
    values = dict(engine="gpu", step_id=1, start_ns=100, end_ns=200, mode="gpu", num_own_rows=1)
    with pytest.raises(InvalidArgument) as error:
        StepRecord(**{**values, **change})
    assert error.value.field == field


def test_reading_a_malformed_file(tmp_path):
    good = gpu_record(1).to_json()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(good + "\n" + good[:20])  # killed mid-write: the partial last line is skipped
    assert read_timeline(cut) == [gpu_record(1)]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(good + "\n{not json\n" + good + "\n")
    with pytest.raises(InvalidArgument, match="broken.jsonl:2"):
        read_timeline(broken)
    alien = tmp_path / "alien.jsonl"
    alien.write_text('{"engine": "gpu", "colour": "blue"}\n')
    with pytest.raises(InvalidArgument, match="unknown fields"):
        read_timeline(alien)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"engine": "gpu"}\n')
    with pytest.raises(InvalidArgument, match="missing.jsonl:1"):
        read_timeline(missing)


def test_daemon_refuses_an_unwritable_timeline_before_loading(tmp_path):
    """A real daemon process (its logging set-up stays out of this test process): exit status 2 and
    one line naming the flag, before the model (which does not exist) is looked at."""
    path = tmp_path / "no-such-dir" / "gpu.jsonl"
    done = subprocess.run([sys.executable, "-m", "gpu_service", "--model", str(tmp_path / "no-model"),
                           "--step-timeline", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"gpu_service: error: --step-timeline: cannot open {path}: No such file or directory"


def test_modes_and_hows_are_taken_in_either_case():
    class Mode:  # an enum member, as the CPU runner's ExecutionMode
        value = "Cooperative"

    record = StepRecord("cpu", 1, 0, 1, Mode(), 1, joins=[JoinedRows("p", 1, 1)], how="joined")
    assert (record.mode, record.how, record.joins) == ("cooperative", "JOINED", (JoinedRows("p", 1, 1),))
    assert StepRecord.from_dict(json.loads(record.to_json())) == record


class JoinHow(enum.IntEnum):  # as dualpace.engine.assist.assist_types.JoinHow
    UNSPECIFIED = 0
    JOINED = 1
    SPLIT = 2
    STAGED = 3


@dataclass
class JoinInfo:  # as dualpace.engine.assist.assist_types.AssistJoinInfo
    how: JoinHow = JoinHow.UNSPECIFIED
    engine_step_id: int = 0
    gpu_wait_us: int = 0
    step_start_ns: int = 0
    step_end_ns: int = 0


def test_assisted_record_fields_from_the_join_info():
    fields = assisted_record_fields(12, JoinInfo(JoinHow.SPLIT, 40, 3, 1000, 5000), 700)
    record = StepRecord("cpu", 5, 900, 6000, "cooperative", 2, **fields)
    assert (record.iteration_id, record.engine_step_id, record.how) == (12, 40, "SPLIT")
    assert (record.engine_step_start_ns, record.engine_step_end_ns, record.gpu_wait_ns) == (1000, 5000, 3000)
    assert record.attention_ns == 700
    staged = StepRecord("cpu", 6, 0, 1, "assisted", 1, **assisted_record_fields(13, JoinInfo(JoinHow.STAGED), 5))
    assert (staged.engine_step_id, staged.how, staged.iteration_id) == (None, "", 13)
    assert assisted_record_fields(14, None, -1) == {"iteration_id": 14, "attention_ns": 0, "runqueue_delay_ns": 0}
    assert StepRecord("cpu", 7, 0, 1, "assisted", 1, **assisted_record_fields(15, None, 5, 4000)).runqueue_delay_ns == 4000
    assert StepRecord("gpu", 1, 0, 1, "gpu", 1, how=JoinHow.UNSPECIFIED).how == ""


def test_record_step_never_raises_on_the_step_thread(caplog):
    timeline = StepTimeline()
    assert timeline.record_step(engine="gpu", step_id=1, start_ns=0, end_ns=1, mode="warp", num_own_rows=1) is None
    assert timeline.record_step(engine="gpu", step_id=2, colour="blue") is None
    assert timeline.num_invalid == 2 and timeline.records() == []
    assert sum("could not be built" in r.message for r in caplog.records) == 1  # logged once
    assert timeline.record_step(engine="gpu", step_id=3, start_ns=0, end_ns=1, mode="gpu", num_own_rows=1)
