"""MigrateOut's caller cancelled at each phase of a move (a router restart, a deadline).

Whatever the phase, no request is stranded: the source's blocks return to its free pool,
the target keeps none for a move it did not commit, and the client's stream either runs
on to the end on the source (cancelled before the KV was all sent) or ends with
migrated_to and resumes on the target (cancelled later), greedy-identical to an
uninterrupted run. Phases are held by a transport wrapper (and the step lock for the
pause), never by sleeping; every wait is for a state, with a generous guard.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.migration import migrate_out
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from tests.helpers import data_socket_send, until

NUM_BLOCKS = 64
GUARD_S = 60.0  # a hang guard, not a timing assertion
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


class PhaseHold:
    """A transport to an in-process target (over its data socket) that stops at one phase until released."""

    def __init__(self, target: EngineLoop, phase: str):
        self.phase = phase
        self.reached = asyncio.Event()
        self.release = asyncio.Event()
        self._send = data_socket_send(target, hold=self._hold)

    async def _hold(self, phase: str) -> None:
        if phase == self.phase:
            self.reached.set()
            await self.release.wait()

    async def __call__(self, header, outgoing) -> str:
        return await self._send(header, outgoing)


async def started(tiny, name: str, step_lock: threading.Lock | None = None) -> tuple[EngineLoop, asyncio.Task]:
    loop = EngineLoop(EngineCore(tiny, EngineConfig(name=name, num_kv_blocks=NUM_BLOCKS, block_size=8)),
                      step_lock=step_lock)
    return loop, asyncio.create_task(loop.run())


async def wait_tokens(channel, count: int) -> None:
    async for _ in channel.follow():
        if len(channel.output_token_ids) >= count:
            return


async def cancel_and_wait(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# Phases of import_over_data_socket (tests/helpers.py); before_pause: the pause never reached a boundary.
@pytest.mark.parametrize("phase, lands_on_target", [
    ("before_pause", False), ("before_begin", False), ("verified", True), ("committed", True)])
async def test_cancelled_migrate_out_strands_nothing(tiny, phase, lands_on_target):
    step_lock = threading.Lock()
    (source, source_task), (target, target_task) = await started(tiny, "src", step_lock), await started(tiny, "dst")
    channel = await source.add_request("m", PROMPT, PARAMS)
    await asyncio.wait_for(wait_tokens(channel, 5), GUARD_S)
    send = PhaseHold(target, phase)
    if phase == "before_pause":
        step_lock.acquire()  # no step boundary: the pause command stays queued
        try:
            migration = asyncio.create_task(migrate_out(source, "m", send))
            await until(lambda: source._commands, "the pause is queued", GUARD_S)
            await cancel_and_wait(migration)
        finally:
            step_lock.release()
    else:
        migration = asyncio.create_task(migrate_out(source, "m", send))
        await asyncio.wait_for(send.reached.wait(), GUARD_S)
        await cancel_and_wait(migration)
        send.release.set()

    expected = OfflineGenerator(tiny).generate([PROMPT], [PARAMS])[0].output_token_ids
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]  # ends either way
    if lands_on_target:
        assert channel.migrated_to == "dst"
        rest = [t async for update in target.channel("m").follow(len(tokens)) for t in update.new_token_ids]
        assert tokens + rest == expected
        assert target.channel("m").finish_reason == FinishReason.LENGTH
    else:
        assert channel.migrated_to is None and channel.finish_reason == FinishReason.LENGTH
        assert tokens == expected
        with pytest.raises(Exception):
            target.channel("m")  # the target never made it live
    await until(lambda: not source.core.scheduler.requests and not target.core.scheduler.requests,
                "both engines hold no request", GUARD_S)
    await until(lambda: source.load().kv_blocks_used == 0 and target.load().kv_blocks_used == 0,
                "every KV block is back in both free pools", GUARD_S)
    for loop, task in ((source, source_task), (target, target_task)):
        loop.stop()
        await task
        loop.close()
