"""dualpace/engine/assist/shm_doorbell.py's wait: when the value is seen (`seen_ns`), and a wait told the
value is not due yet sleeps on the futex first, then spins (ring_pacing.WakeAhead's use)."""

from __future__ import annotations

import mmap
import time

import pytest

from dualpace.engine.assist import shm_doorbell
from dualpace.engine.assist.shm_doorbell import Doorbell

pytestmark = pytest.mark.skipif(not shm_doorbell.SUPPORTED, reason="doorbells need Linux x86-64")


@pytest.fixture
def doorbell():
    mapping = mmap.mmap(-1, 4096)
    bell = Doorbell(mapping, 0, spin_s=0.0)
    yield bell
    bell.release()
    mapping.close()


def test_a_value_already_there_is_not_waited_for(doorbell):
    doorbell.post(1)
    assert doorbell.wait(1, time.monotonic() + 5) and doorbell.seen_ns == 0 and doorbell.num_sleeps == 0


def test_sleep_first_sleeps_on_the_futex_before_any_spin_and_a_post_ends_it(doorbell, monkeypatch):
    calls = []

    def futex(op, value, timeout_s):  # the peer posts while this side sleeps
        calls.append((op, value, timeout_s))
        doorbell._words[0] = 1

    monkeypatch.setattr(doorbell, "_futex", futex)
    posted_before_ns = time.monotonic_ns()
    assert doorbell.wait(1, time.monotonic() + 5, sleep_first_s=0.25, spin_s=10.0)
    assert calls == [(shm_doorbell._FUTEX_WAIT, 0, 0.25)]  # slept first, for that long, and never spun 10 s
    assert doorbell.seen_ns >= posted_before_ns and doorbell.num_sleeps == 1
    assert doorbell._words[1] == 0  # not left marked as sleeping


def test_without_sleep_first_the_futex_waits_until_the_deadline(doorbell, monkeypatch):
    calls = []

    def futex(op, value, timeout_s):
        calls.append(timeout_s)
        doorbell._words[0] = 1

    monkeypatch.setattr(doorbell, "_futex", futex)
    assert doorbell.wait(1, time.monotonic() + 0.5)
    assert len(calls) == 1 and calls[0] > 0.25 and doorbell.seen_ns > 0


def test_nothing_posted_ends_at_the_deadline_after_sleeping_first(doorbell):
    assert not doorbell.wait(1, time.monotonic() + 0.02, sleep_first_s=0.01, spin_s=0.001)
    assert doorbell.seen_ns == 0 and doorbell.num_sleeps >= 1
