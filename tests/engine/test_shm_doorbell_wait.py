"""dualpace/engine/assist/shm_doorbell.py's wait: when the value is seen (`seen_ns`), and how long
the futex sleeps."""

from __future__ import annotations

import mmap
import time
from types import SimpleNamespace

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


def test_the_futex_waits_until_the_deadline(doorbell, monkeypatch):
    calls = []

    def futex(op, value, timeout_s):
        calls.append(timeout_s)
        doorbell._words[0] = 1

    monkeypatch.setattr(doorbell, "_futex", futex)
    now_s = 100.0  # the doorbell's clock, stopped: the futex's timeout is exactly what is left
    monkeypatch.setattr(shm_doorbell, "time", SimpleNamespace(monotonic=lambda: now_s, perf_counter=time.perf_counter,
                                                              monotonic_ns=time.monotonic_ns))
    assert doorbell.wait(1, now_s + 0.5)
    assert calls == [0.5] and doorbell.seen_ns > 0
