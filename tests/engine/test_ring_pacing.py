"""dualpace/engine/ring_pacing.py and the doorbell's busy spin: the predictor's busy spin follows
the observed answer interval within its bounds; a layer's stamps split its round trip; a doorbell
wait that busy-spins sees a post from another thread without a futex sleep
(tests/gpu_service/test_join_ring_stamps.py: a joined iteration through a real ring)."""

from __future__ import annotations

import mmap
import threading
import time

import pytest
from dualpace.engine import ring_pacing
from dualpace.engine.ring_pacing import MAX_BUSY_SPIN_S, SPIN_MARGIN_S, AnswerPredictor, LayerMarks
from dualpace.engine.shm_doorbell import SUPPORTED, Doorbell

US = 1_000


def test_no_busy_spin_before_an_observation_then_until_the_predicted_answer():
    predictor = AnswerPredictor()
    assert predictor.busy_spin_s(0, 0) == 0.0
    predictor.observe(400 * US)
    # a wait that starts 300 us after the send: 100 us to the predicted answer, plus the margin
    assert predictor.busy_spin_s(1_000_000, 1_000_000 + 300 * US) == pytest.approx(100e-6 + SPIN_MARGIN_S)
    assert predictor.busy_spin_s(0, 10_000 * US) == 0.0  # long past it: the answer is late, no busy spin
    predictor.observe(50_000 * US)  # one slow layer pulls the EMA up, the bound holds
    assert predictor.busy_spin_s(0, 0) == MAX_BUSY_SPIN_S
    predictor.observe(0)
    predictor.observe(-5)  # a clock step backwards or an unstamped peer: ignored
    assert predictor.expected_ns == round(0.7 * 400 * US + 0.3 * 50_000 * US)


def test_layer_marks_split_a_round_trip():
    marks = LayerMarks()
    # sent at 0, the GPU waits from 600 us; the CPU saw them at 100, answered at 700; GPU had it at 750
    marks.add(0, 600 * US, 750 * US, (100 * US, 700 * US))
    # an answer already there when the GPU looked: no wait before it, the hop is the look itself
    marks.add(0, 900 * US, 905 * US, (50 * US, 300 * US))
    marks.add(0, 0, 1, None)  # an unstamped answer (an older client): not counted
    assert marks.record_fields() == {"num_marked_layers": 2, "down_hop_ns": 150 * US, "cpu_layer_ns": 850 * US,
                                     "wait_before_answer_ns": 100 * US, "up_hop_ns": 55 * US, "num_wait_sleeps": 0}
    total = LayerMarks(num_sleeps=1)
    total.merge(marks)
    assert total.num_layers == 2 and total.up_hop_ns == 55 * US and total.num_sleeps == 1


def test_stamps_round_trip_and_foreign_payloads_are_not_stamps():
    assert ring_pacing.qkv_stamp(ring_pacing.QKV_STAMP.pack(123)) == 123
    assert ring_pacing.output_stamp(ring_pacing.OUTPUT_STAMP.pack(1, 2)) == (1, 2)
    assert ring_pacing.qkv_stamp(b"") is None and ring_pacing.output_stamp(b"tail") is None


@pytest.mark.skipif(not SUPPORTED, reason="shared-memory doorbells need Linux x86-64")
def test_a_busy_spinning_wait_sees_a_post_without_sleeping():
    mapping = mmap.mmap(-1, 4096)
    consumer, producer = Doorbell(mapping, 0, spin_s=0.0), Doorbell(mapping, 0)
    poster = threading.Timer(0.01, producer.post, (1,))
    poster.start()
    try:
        assert consumer.wait(1, time.monotonic() + 30, busy_spin_s=30.0)
        assert consumer.num_sleeps == 0  # the busy spin (it lets the poster's thread have the GIL) saw it
        poster2 = threading.Timer(0.01, producer.post, (2,))
        poster2.start()
        assert consumer.wait(2, time.monotonic() + 30)  # no busy spin, no yielding spin: the futex
        poster2.join()
        assert consumer.num_sleeps == 1
    finally:
        poster.join()
        consumer.release()
        producer.release()
        mapping.close()
