"""JoinDesk: offer blocks the session's thread until the step settles the join, declines when the
running step cannot end in time, and leaves nothing behind after a step."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from dualpace.engine.join_desk import JoinDesk, JoinOutcome, JoinRequest
from dualpace.errors import Overloaded, Unavailable


class RecordingChannel:
    def __init__(self):
        self.failed: list[BaseException] = []

    def send_qkv(self, layer, q, k, v):
        pass

    def receive_attention(self, layer, deadline_s):
        return None

    def finish(self, logits_rows, info):
        pass

    def fail(self, error):
        self.failed.append(error)


def make_join(num_rows: int = 1) -> JoinRequest:
    begin = SimpleNamespace(token_ids=[7] * num_rows, positions=list(range(num_rows)))
    return JoinRequest(begin, RecordingChannel(), offered_s=0.0)


def offer_in_thread(desk: JoinDesk, join: JoinRequest, max_wait_s: float, **kwargs):
    answer: list[JoinOutcome] = []
    thread = threading.Thread(target=lambda: answer.append(desk.offer(join, max_wait_s, **kwargs)))
    thread.start()
    return thread, answer


def wait_until(condition) -> None:
    for _ in range(10_000):
        if condition():
            return
        time.sleep(0.001)
    raise AssertionError("condition not reached")


def test_taken_join_blocks_the_session_until_settled():
    desk = JoinDesk(num_layers=4)
    woken = []
    desk.on_pending(lambda: woken.append(True))
    join = make_join(2)
    thread, answer = offer_in_thread(desk, join, max_wait_s=30)
    wait_until(lambda: desk.has_pending)
    assert woken
    taken = desk.take(max_rows=8)
    assert taken == [join] and not desk.has_pending
    thread.join(0.05)
    assert thread.is_alive() and not answer  # taken but not settled: still blocked
    desk.settle(join, JoinOutcome.TAKEN_DONE)
    thread.join(10)
    assert answer == [JoinOutcome.TAKEN_DONE]
    desk.end_step()
    assert join.channel.failed == []


def test_not_taken_in_time_is_removed_from_the_desk():
    desk = JoinDesk(num_layers=4)
    join = make_join()
    assert desk.offer(join, max_wait_s=0.01) is JoinOutcome.NOT_TAKEN
    assert not desk.has_pending
    assert desk.take(max_rows=8) == []


def test_dualpace_declines_at_once_while_a_long_step_runs():
    desk = JoinDesk(num_layers=4)
    desk.take(max_rows=8)  # a step without joins is running, at layer 0
    assert desk.offer(make_join(), max_wait_s=30) is JoinOutcome.NOT_TAKEN
    desk.step_progress(layer=2, layer_ms=50.0)  # one layer left, but 50 ms > the 10 ms the CPU may wait
    assert desk.offer(make_join(), max_wait_s=0.01) is JoinOutcome.NOT_TAKEN
    assert not desk.has_pending


def test_gated_waits_through_a_running_step():
    desk = JoinDesk(num_layers=4)
    desk.take(max_rows=8)
    join = make_join()
    thread, answer = offer_in_thread(desk, join, 30, decline_when_late=False)
    wait_until(lambda: desk.has_pending)
    desk.end_step()
    assert desk.take(max_rows=8) == [join]
    desk.settle(join, JoinOutcome.TAKEN_DONE)
    thread.join(10)
    assert answer == [JoinOutcome.TAKEN_DONE]


def test_take_respects_max_rows_in_order():
    desk = JoinDesk(num_layers=2)
    joins = [make_join(3), make_join(3), make_join(1)]
    threads = []
    for join in joins:
        threads.append(offer_in_thread(desk, join, 30)[0])
        wait_until(lambda: join in desk._pending)
    assert desk.take(max_rows=4) == [joins[0]]  # the second does not fit; the third waits its turn
    assert desk.take(max_rows=4) == [joins[1], joins[2]]
    desk.fail_taken(Unavailable("step failed"))
    for thread in threads:
        thread.join(10)
    assert all(j.outcome is JoinOutcome.DROPPED for j in joins)
    assert all(isinstance(j.channel.failed[0], Unavailable) for j in joins)


def test_end_step_fails_an_unsettled_join_and_empties_the_desk():
    desk = JoinDesk(num_layers=2)
    dropped, kept = make_join(), make_join()
    thread_a, answer_a = offer_in_thread(desk, dropped, 30)
    thread_b, answer_b = offer_in_thread(desk, kept, 30)
    wait_until(lambda: len(desk._pending) == 2)
    desk.take(max_rows=8)
    dropped.channel.fail(Overloaded("stalled"))
    desk.settle(dropped, JoinOutcome.DROPPED, Overloaded("stalled"))
    desk.end_step()  # `kept` was never settled: failed Unavailable, not left waiting
    thread_a.join(10)
    thread_b.join(10)
    assert answer_a == [JoinOutcome.DROPPED] and answer_b == [JoinOutcome.DROPPED]
    assert isinstance(kept.error, Unavailable) and isinstance(kept.channel.failed[0], Unavailable)
    assert len(dropped.channel.failed) == 1  # end_step did not fail it twice
    assert not desk.has_pending and desk._taken == []


def test_withdraw_and_bad_input():
    desk = JoinDesk(num_layers=2)
    join = make_join()
    thread, answer = offer_in_thread(desk, join, 30)
    wait_until(lambda: desk.has_pending)
    assert desk.withdraw(join)
    thread.join(10)
    assert answer == [JoinOutcome.NOT_TAKEN]
    assert not desk.withdraw(join)
    with pytest.raises(ValueError):
        desk.offer(make_join(), max_wait_s=-1)
    with pytest.raises(ValueError):
        JoinDesk(num_layers=0)
    with pytest.raises(ValueError):
        desk.settle(join, JoinOutcome.NOT_TAKEN)
