"""EngineLoop: concurrent streams, late followers, aborts between steps, commands on an idle loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.errors import RequestNotFound
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from tests.helpers import until


async def collect(channel, from_index: int = 0) -> tuple[list[int], FinishReason | None]:
    tokens, reason = [], None
    async for update in channel.follow(from_index):
        assert update.first_token_index == from_index + len(tokens)
        tokens.extend(update.new_token_ids)
        reason = update.finish_reason
    return tokens, reason


async def test_concurrent_streams_and_late_follower(tiny):
    loop = EngineLoop(EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=8)))
    runner = asyncio.create_task(loop.run())
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[i + 1] * (i + 2) for i in range(8)]
    channels = [await loop.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(collect(c) for c in channels))
    for prompt, (tokens, reason) in zip(prompts, results):
        assert tokens == OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
        assert reason == FinishReason.LENGTH
    late_tokens, _ = await collect(loop.channel("r3"), from_index=5)
    assert late_tokens == results[3][0][5:]
    assert loop.load().kv_blocks_used == 0
    loop.stop()
    await runner
    loop.close()


async def test_abort_ends_stream_and_frees_blocks(tiny):
    loop = EngineLoop(EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=8)))
    runner = asyncio.create_task(loop.run())
    channel = await loop.add_request("long", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
    async for update in channel.follow():
        if len(channel.output_token_ids) >= 3:
            break
    await loop.abort("long")
    tokens, reason = await collect(channel)
    assert reason == FinishReason.ABORT
    assert loop.load().kv_blocks_used == 0
    with pytest.raises(RequestNotFound):
        await loop.abort("long")
    loop.stop()
    await runner
    loop.close()


async def test_a_command_on_an_idle_loop_runs_at_once(tiny):
    """No step runs while the loop is parked, so call() runs the command without suspending (no
    hop through the loop's task and back); the loop then picks up the work the command made."""
    loop = EngineLoop(EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=8)))
    runner = asyncio.create_task(loop.run())
    await until(lambda: loop.parked, "the idle loop parks")
    call = loop.call(lambda: 42)
    with pytest.raises(StopIteration) as returned:
        call.send(None)  # completes on its first step: it never waited
    assert returned.value.value == 42
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    await until(lambda: loop.parked, "the idle loop parks")
    channel = await loop.add_request("idle", [4, 5, 6], params)
    tokens, reason = await collect(channel)
    assert tokens == OfflineGenerator(tiny).generate([[4, 5, 6]], [params])[0].output_token_ids
    assert reason == FinishReason.LENGTH
    loop.stop()
    await runner
    loop.close()


async def test_a_command_waits_for_the_step_in_flight(tiny):
    step_lock = threading.Lock()
    loop = EngineLoop(EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=8)), step_lock=step_lock)
    runner = asyncio.create_task(loop.run())
    channel = await loop.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
    async for _ in channel.follow():
        break
    ran = []
    step_lock.acquire()  # the next step cannot finish: the command must wait for its end
    try:
        for _ in range(10_000):
            if not loop.gate.wait_turn(0):  # a step has started (and waits for the lock)
                break
            await asyncio.sleep(0.001)
        command = asyncio.create_task(loop.call(lambda: ran.append(len(channel.output_token_ids))))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not loop.parked and not ran and not command.done()
    finally:
        step_lock.release()
    await command
    assert len(ran) == 1
    await loop.abort("busy")
    loop.stop()
    await runner
    loop.close()
