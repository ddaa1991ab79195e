"""The hand-off hold: a request the router will move after its first token is paused in the step
that samples it, and its move starts without waiting for the engine's next step boundary.

- scheduler: the flagged request leaves the running batch with its first token (`held`), no later
  step runs it, `pause` takes it as it is, `release_hold` lets it decode here;
- loop + migrate_out: the move of a held request completes while the source is stuck inside its
  next step (its step lock held), and the output is greedy-identical to an unmoved run;
- nothing lost: a failed transfer resumes it on the source, a hold no move takes is released.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from dualpace.engine.transfer.migration import migrate_out
from dualpace.engine.request import EngineRequest, RequestState
from dualpace.engine.scheduler import Scheduler, SchedulerConfig
from dualpace.engine.step_plan import StepResult
from dualpace.errors import InvalidArgument, Unavailable
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from tests.engine.test_migration import started, stop, wait_tokens
from tests.helpers import data_socket_send

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)


def step(scheduler: Scheduler, token_id: int = 7):
    plan = scheduler.schedule()
    sampled = {seq.request_id: token_id for seq in plan.sequences if seq.sample}
    return plan, scheduler.apply(plan, StepResult(sampled))


def test_scheduler_holds_the_flagged_request_after_its_first_token():
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=64), num_blocks=32, block_size=4, max_context_tokens=256)
    held = EngineRequest("h", list(PROMPT), SamplingParams(max_tokens=8, ignore_eos=True), seed=1,
                         hold_after_first_token=True)
    other = EngineRequest("o", list(PROMPT), SamplingParams(max_tokens=8, ignore_eos=True), seed=2)
    scheduler.add(held)
    scheduler.add(other)
    _, events = step(scheduler)
    by_id = {event.request_id: event for event in events}
    assert by_id["h"].held and by_id["h"].new_token_ids == (7,)
    assert not by_id["o"].held
    assert held.state == RequestState.PAUSED and held not in scheduler.running
    assert held.num_computed_tokens == len(PROMPT) and scheduler.blocks.has("h")  # keeps its KV
    plan, _ = step(scheduler)
    assert [seq.request_id for seq in plan.sequences] == ["o"]  # the next step never runs it
    assert scheduler.pause("h") is held  # the move takes it as it is
    with pytest.raises(InvalidArgument, match="already paused"):  # a second move does not
        scheduler.pause("h")
    assert not scheduler.release_hold("h")  # taken: a late timeout leaves it alone
    scheduler.resume("h")  # e.g. the transfer failed
    assert held.state == RequestState.RUNNING
    plan, events = step(scheduler)
    assert {seq.request_id for seq in plan.sequences} == {"h", "o"}
    assert not any(event.held for event in events)  # only its first token holds it


def test_release_hold_lets_it_decode_here_and_finishing_tokens_never_hold():
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=64), num_blocks=32, block_size=4, max_context_tokens=256)
    scheduler.add(EngineRequest("h", list(PROMPT), SamplingParams(max_tokens=4, ignore_eos=True), seed=1,
                                hold_after_first_token=True))
    scheduler.add(EngineRequest("one", list(PROMPT), SamplingParams(max_tokens=1, ignore_eos=True), seed=2,
                                hold_after_first_token=True))
    _, events = step(scheduler)
    assert [event.held for event in events] == [True, False]  # max_tokens=1: finished, nothing to hold
    assert scheduler.release_hold("h") and not scheduler.release_hold("h")
    for _ in range(3):
        _, events = step(scheduler)
    assert events[-1].finish_reason == FinishReason.LENGTH and not scheduler.has_work


def test_aborting_a_held_request_frees_its_blocks():
    scheduler = Scheduler(SchedulerConfig(), num_blocks=32, block_size=4, max_context_tokens=256)
    scheduler.add(EngineRequest("h", list(PROMPT), GREEDY, seed=1, hold_after_first_token=True))
    step(scheduler)
    scheduler.abort("h")
    assert scheduler.blocks.num_used_blocks == 0 and not scheduler.release_hold("h")


def expected_tokens(tiny) -> list[int]:
    return OfflineGenerator(tiny).generate([PROMPT], [GREEDY])[0].output_token_ids


async def test_move_of_a_held_request_does_not_wait_for_the_next_step(tiny):
    target, lock = await started(tiny, "dst", block_size=4), threading.Lock()
    source = await started(tiny, "src", step_lock=lock)
    source_loop = source[0]
    # Another request keeps the source stepping: without the hold, the move would wait for its steps.
    busy = await source_loop.add_request("busy", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    channel = await source_loop.add_request("m", PROMPT, GREEDY, hold_after_first_token=True)
    await wait_tokens(channel, 1)
    assert "m" in source_loop.holds  # registered before its first token was published
    await asyncio.to_thread(lock.acquire)  # from now on no source step can finish: no boundary comes
    try:
        # The whole move, commit included, while the source is stuck (10 s: a failure bound only).
        sent = asyncio.create_task(migrate_out(source_loop, "m", data_socket_send(target[0])))
        await asyncio.wait_for(until_moved(channel), timeout=10)
        assert channel.output_token_ids == expected_tokens(tiny)[:1]  # the next step did not run it
    finally:
        lock.release()
    stats = await sent
    assert stats.target_engine == "dst" and source_loop.holds.num_taken == 1
    rest = [t async for update in target[0].channel("m").follow(1) for t in update.new_token_ids]
    assert channel.output_token_ids + rest == expected_tokens(tiny)
    assert not busy.done
    await source_loop.abort("busy")
    assert source_loop.load().kv_blocks_used == 0 and target[0].load().kv_blocks_used == 0
    await stop(source, target)


async def until_moved(channel) -> None:
    async for _ in channel.follow():
        pass
    assert channel.migrated_to is not None


async def test_failed_hand_off_resumes_the_held_request_on_the_source(tiny):
    source = await started(tiny, "src")
    channel = await source[0].add_request("m", PROMPT, GREEDY, hold_after_first_token=True)
    await wait_tokens(channel, 1)

    async def failing_send(header, outgoing) -> str:
        raise Unavailable("the CPU engine is down")

    try:
        await migrate_out(source[0], "m", failing_send)
    except Unavailable:
        pass
    else:
        raise AssertionError("the move should have failed")
    async for _ in channel.follow():
        pass
    assert channel.output_token_ids == expected_tokens(tiny) and channel.finish_reason == FinishReason.LENGTH
    assert source[0].load().kv_blocks_used == 0
    await stop(source)


async def test_a_hold_no_move_takes_is_released(tiny):
    source = await started(tiny, "src")
    source[0].holds.timeout_s = 0.05
    channel = await source[0].add_request("m", PROMPT, GREEDY, hold_after_first_token=True)
    async for _ in channel.follow():  # bounded: the release comes after 0.05 s
        pass
    assert channel.output_token_ids == expected_tokens(tiny)
    assert source[0].holds.num_released == 1 and source[0].load().kv_blocks_used == 0
    await stop(source)


def test_the_flag_crosses_the_wire():
    from dualpace.wire.engine_messages import new_request_options_from_pb, new_request_to_pb

    message = new_request_to_pb("r", PROMPT, GREEDY, keep_running_on_disconnect=True, hold_after_first_token=True)
    options = new_request_options_from_pb(message.new_request)
    assert options.hold_after_first_token and options.keep_running_on_disconnect
    assert not new_request_options_from_pb(new_request_to_pb("r", PROMPT, GREEDY).new_request).hold_after_first_token


def test_only_dualpace_holds_for_the_hand_off():
    from dualpace.policy.policies import Policy, traits

    assert traits(Policy.DUALPACE).holds_for_handoff
    assert not traits(Policy.GATED).holds_for_handoff and not traits(Policy.GPU_ONLY).holds_for_handoff
