"""dualpace/engine/assist/ring_pacing.py: a layer's stamps split its round trip, a long wait is counted
apart, and a payload that is not a stamp is none; dualpace/engine/run_delay.py reads this thread's
run-queue time (tests/gpu_service/test_join_ring_stamps.py: a joined iteration through a real ring)."""

from __future__ import annotations

import os

import pytest

from dualpace.engine.assist import ring_pacing
from dualpace.engine.assist.ring_pacing import LayerMarks
from dualpace.engine.run_delay import runqueue_wait_ns

US = 1_000


def test_layer_marks_split_a_round_trip():
    marks = LayerMarks()
    # sent at 0, the GPU waits from 600 us; the CPU saw them at 100, answered at 700; GPU had it at 750
    marks.add(0, 600 * US, 750 * US, (100 * US, 700 * US))
    # an answer already there when the GPU looked: no wait before it, the hop is the look itself
    marks.add(0, 900 * US, 905 * US, (50 * US, 300 * US))
    marks.add(0, 0, 1, None)  # an unstamped answer (an older client): not counted
    assert marks.record_fields() == {"num_marked_layers": 2, "down_hop_ns": 150 * US, "cpu_layer_ns": 850 * US,
                                     "wait_before_answer_ns": 100 * US, "up_hop_ns": 55 * US, "num_wait_sleeps": 0,
                                     "num_long_waits": 0, "long_wait_ns": 0}
    marks.add(0, 1000 * US, 2500 * US, (200 * US, 2400 * US))  # a 1.5 ms wait: the tail, counted apart
    assert (marks.num_long_waits, marks.long_wait_ns) == (1, 1500 * US)
    total = LayerMarks(num_sleeps=1)
    total.merge(marks)
    assert total.num_layers == 3 and total.up_hop_ns == 155 * US and total.num_sleeps == 1
    assert total.num_long_waits == 1


def test_stamps_round_trip_and_foreign_payloads_are_not_stamps():
    assert ring_pacing.output_stamp(ring_pacing.OUTPUT_STAMP.pack(1, 2)) == (1, 2)
    assert ring_pacing.output_stamp(b"") is None and ring_pacing.output_stamp(b"tail") is None


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstats")
def test_the_run_queue_time_is_read_and_never_goes_back():
    first = runqueue_wait_ns()
    sum(range(100_000))
    assert runqueue_wait_ns() >= first >= 0
