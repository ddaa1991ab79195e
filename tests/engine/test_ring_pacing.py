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


def test_wake_ahead_sleeps_until_shortly_before_the_shortest_recent_gap():
    margin = ring_pacing.WAKE_MARGIN_NS
    ahead = ring_pacing.WakeAhead(spin_ns=200 * US)
    assert (ahead.sleep_first_ns(), ahead.spin_ns()) == (0, 200 * US)  # no gap yet: the usual wait
    ahead.seen(5_000 * US)  # the first q/k/v: nothing posted before them, no gap
    assert ahead.sleep_first_ns() == 0
    ahead.posted(1_000 * US)
    ahead.seen(3_000 * US)  # a 2 ms gap
    assert ahead.sleep_first_ns() == 2_000 * US - margin and ahead.spin_ns() == 200 * US + 2 * margin
    for posted, seen in ((4_000, 5_500), (6_000, 16_000), (17_000, 19_000)):  # 1.5 ms, a late 10 ms, 2 ms
        ahead.posted(posted * US)
        ahead.seen(seen * US)
    assert ahead.sleep_first_ns() == 1_500 * US - margin  # the shortest: a late layer does not push it out
    for _ in range(ring_pacing.WAKE_AHEAD_GAPS):
        ahead.posted(20_000 * US)
        ahead.seen(20_000 * US + margin // 2)  # gaps shorter than the margin: spin at once
    assert ahead.sleep_first_ns() == 0
