"""JoinDesk: offer blocks the session's thread until the step settles the join, declines when the
running step cannot end in time, and leaves nothing behind after a step."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.assist.join_desk import JoinDesk, JoinOutcome, JoinRequest
from dualpace.engine.assist.joined_step import JoinSettings
from dualpace.engine.loop import EngineLoop
from dualpace.errors import Overloaded, Unavailable
from dualpace.kv.storage import KVStorage
from dualpace.profile.cost_model import layer_costs
from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors
from dualpace.sampling import SamplingParams
from tests.helpers import reference_tokens, until
from tests.model.test_split_forward import AttendingChannel


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


def test_a_declined_join_answers_not_taken():
    desk = JoinDesk(num_layers=2)
    join = make_join()
    thread, answer = offer_in_thread(desk, join, 30)
    wait_until(lambda: desk.has_pending)
    assert desk.take(max_rows=8) == [join]
    desk.settle(join, JoinOutcome.NOT_TAKEN)  # the planner chose staged
    thread.join(10)
    desk.end_step()
    assert answer == [JoinOutcome.NOT_TAKEN] and join.channel.failed == []


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


# ------------------------------------------------------------------ a real engine's steps with joins


class RemoteRequest:
    """A CPU engine's request: prefilled on its own KV, then its decode rows join the GPU's steps."""

    def __init__(self, loaded, prompt: list[int], stall_at_layer: int | None = None):
        cfg = loaded.config
        self.kv = KVStorage(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, loaded.model.dtype)
        self.forward = PagedForward(loaded.model, self.kv)
        self.prompt, self.block_ids = prompt, list(range(1, 17))
        self.tokens = [int(self.forward.forward([SequenceWork(prompt, 0, self.block_ids)])[0].argmax())]
        self.channel = AttendingChannel(self.kv, cfg.head_dim**-0.5, stall_at_layer)

    def next_join(self, iteration_id: int) -> JoinRequest:
        position = len(self.prompt) + len(self.tokens) - 1
        work = SequenceWork([self.tokens[-1]], position, self.block_ids)
        self.channel.step = build_step_tensors([work], 4, torch.device("cpu"))
        begin = SimpleNamespace(iteration_id=iteration_id, token_ids=[self.tokens[-1]], positions=[position],
                                max_join_wait_us=0, expected_layer_us=0)
        return JoinRequest(begin, self.channel, offered_s=time.monotonic())


def engine_with_desk(loaded, prompts):
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=64, block_size=4))
    desk = JoinDesk(loaded.config.num_layers)
    core.runner.set_join_desk(desk)
    for i, prompt in enumerate(prompts):
        core.add_request(f"own{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    return core, desk


def step_with(core: EngineCore, desk: JoinDesk, join: JoinRequest | None, outputs: dict):
    thread = answer = None
    if join is not None:
        thread, answer = offer_in_thread(desk, join, 30, decline_when_late=False)
        wait_until(lambda: desk.has_pending)
    _, events = core.step()
    for event in events:
        outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
    if thread is not None:
        thread.join(30)
    return answer


@pytest.mark.parametrize("stall_at_layer", [None, 1])
def test_engine_steps_carry_joins_and_own_outputs_do_not_change(tiny, stall_at_layer):
    rng = random.Random(3)
    prompts = [[rng.randrange(tiny.config.vocab_size) for _ in range(n)] for n in (9, 5)]
    remote_prompt = [rng.randrange(tiny.config.vocab_size) for _ in range(7)]
    plain = EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=4))
    for i, prompt in enumerate(prompts):
        plain.add_request(f"own{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    want: dict = {}
    while plain.has_work:
        step_with(plain, None, None, want)
    core, desk = engine_with_desk(tiny, prompts)
    remote = RemoteRequest(tiny, remote_prompt, stall_at_layer)
    got: dict = {}
    for step in range(12):
        answer = step_with(core, desk, remote.next_join(step), got)
        if stall_at_layer is not None:
            assert answer == [JoinOutcome.DROPPED]
            assert isinstance(remote.channel.errors[-1], Overloaded)
            break
        assert answer == [JoinOutcome.TAKEN_DONE]
        logits, info = remote.channel.finished
        assert info.how in ("joined", "split") and info.step_end_ns >= info.step_start_ns
        remote.tokens.append(int(logits[0].argmax()))
        assert not desk.has_pending and desk._taken == []
    while core.has_work:
        step_with(core, desk, None, got)
    assert got == want  # the own requests' tokens, with joins on board or dropped
    if stall_at_layer is None:
        assert remote.tokens == hf_free_greedy(tiny, remote_prompt, len(remote.tokens))
    assert not desk.has_pending and desk._taken == []


def hf_free_greedy(loaded, prompt: list[int], num_tokens: int) -> list[int]:
    """The remote request's greedy tokens run alone on the plain path (itself checked against HF)."""
    return reference_tokens(loaded, prompt, SamplingParams(max_tokens=num_tokens, ignore_eos=True))


def test_an_idle_engine_runs_a_step_for_a_join_alone(tiny):
    core, desk = engine_with_desk(tiny, [])
    remote = RemoteRequest(tiny, [5, 6, 7])
    assert not core.has_work
    thread, answer = offer_in_thread(desk, remote.next_join(1), 30, decline_when_late=False)
    wait_until(lambda: core.has_work)
    plan, events = core.step()
    thread.join(30)
    assert plan.is_empty and events == [] and answer == [JoinOutcome.TAKEN_DONE]
    assert int(remote.channel.finished[0][0].argmax()) == hf_free_greedy(tiny, [5, 6, 7], 2)[1]


def test_a_failed_step_fails_its_joins_with_unavailable(tiny, monkeypatch):
    core, desk = engine_with_desk(tiny, [[1, 2, 3]])
    remote = RemoteRequest(tiny, [5, 6, 7])

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.runner._joined.split, "run", broken)
    thread, answer = offer_in_thread(desk, remote.next_join(1), 30, decline_when_late=False)
    wait_until(lambda: desk.has_pending)
    with pytest.raises(RuntimeError):
        core.step()
    thread.join(30)
    assert answer == [JoinOutcome.DROPPED] and isinstance(remote.channel.errors[0], Unavailable)
    assert not desk.has_pending and desk._taken == []


def test_an_idle_engine_loop_wakes_for_a_join(tiny):
    core, desk = engine_with_desk(tiny, [])
    remote = RemoteRequest(tiny, [5, 6, 7])

    async def main():
        loop = EngineLoop(core)
        task = asyncio.create_task(loop.run())
        await until(lambda: loop.parked, "the idle loop parks")
        outcome = await asyncio.to_thread(desk.offer, remote.next_join(1), 30, False)
        loop.stop()
        await task
        loop.close()
        return outcome

    assert asyncio.run(main()) is JoinOutcome.TAKEN_DONE
    assert remote.channel.finished is not None


def test_the_planner_may_decline_a_join_to_staged(tiny):
    """dualpace, a CPU much slower than the GPU's own work: staged stages lengthen the step less,
    so the step settles the join NOT_TAKEN before any of its rows ran, and serves its own rows."""
    core = EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=4))
    desk = JoinDesk(tiny.config.num_layers)
    seed = layer_costs(tiny.config.num_layers, {1: 0.1, 64: 0.2}, 0.0)
    core.runner.set_join_desk(desk, JoinSettings(cost_seed=seed))
    core.add_request("own", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    remote = RemoteRequest(tiny, [5, 6, 7])
    join = remote.next_join(1)
    join.begin.max_join_wait_us, join.begin.expected_layer_us = 10_000_000, 1_000_000  # dualpace, 1 s a layer
    thread, answer = offer_in_thread(desk, join, 30, decline_when_late=False)
    wait_until(lambda: desk.has_pending)
    _, events = core.step()
    thread.join(30)
    assert answer == [JoinOutcome.NOT_TAKEN] and remote.channel.finished is None and not remote.channel.errors
    assert [e.request_id for e in events] == ["own"]


def test_an_idle_engine_drops_its_only_join_and_serves_on(tiny):
    core, desk = engine_with_desk(tiny, [])
    remote = RemoteRequest(tiny, [5, 6, 7], stall_at_layer=0)
    answer = step_with(core, desk, remote.next_join(1), {})
    assert answer == [JoinOutcome.DROPPED] and isinstance(remote.channel.errors[0], Overloaded)
    core.add_request("own", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    outputs: dict = {}
    while core.has_work:
        step_with(core, desk, None, outputs)
    assert outputs["own"] == hf_free_greedy(tiny, [1, 2, 3], 2)


def test_a_step_that_ran_nothing_adds_no_record(tiny):
    """After a joined step, steps that return early must not repeat its record (same step id, the
    runner's fields still holding that step's joins): each GPU step id appears once."""
    core, desk = engine_with_desk(tiny, [])
    remote = RemoteRequest(tiny, [5, 6, 7])
    records: list[dict] = []
    loop = EngineLoop(core)
    loop.step_timeline = SimpleNamespace(record_step=lambda **fields: records.append(fields))
    thread, answer = offer_in_thread(desk, remote.next_join(1), 30, decline_when_late=False)
    wait_until(lambda: core.has_work)
    loop._step()
    thread.join(30)
    for _ in range(3):
        loop._step()
    loop.close()
    assert answer == [JoinOutcome.TAKEN_DONE]
    assert [r["step_id"] for r in records] == [core.runner.num_executed_steps] and len(records[0]["joins"]) == 1
