"""The ITL window behind LoadSnapshot's itl_p50_ms / itl_p99_ms: empty steps
are not counted. A known step sequence gives known percentiles, and through a real EngineLoop
empty plans leave the window untouched."""

from __future__ import annotations

import asyncio

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.engine.scheduler import StepPlan
from dualpace.engine.step_window import StepLatencyWindow, percentile
from dualpace.sampling import SamplingParams


def test_known_sequence_with_empty_steps_between():
    window = StepLatencyWindow(num_steps=256)
    busy_ms = [float(ms) for ms in range(1, 101)]  # 1 .. 100 ms
    for ms in busy_ms:
        window.record(ms, is_empty=False)
        window.record(0.01, is_empty=True)  # an idle step after each: would halve the median
    assert len(window) == 100 and window.num_empty_skipped == 100
    assert window.p50_ms == 50.5  # the median of 1..100
    assert window.p99_ms == 100.0  # nearest rank: sorted[int(0.99 * 100)] = the 100th value


def test_empty_steps_alone_report_zero_and_the_window_slides():
    window = StepLatencyWindow(num_steps=4)
    window.record(0.02, is_empty=True)
    assert (window.p50_ms, window.p99_ms, len(window)) == (0.0, 0.0, 0)
    for ms in (100.0, 1.0, 2.0, 3.0, 4.0):  # the 100 ms step leaves the 4-step window
        window.record(ms, is_empty=False)
    assert (window.p50_ms, window.p99_ms) == (2.5, 4.0)


def test_percentile_nearest_rank():
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0


async def test_the_loop_records_only_steps_that_did_work(tiny):
    core = EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=8))
    real_step, num_empty = core.step, 5
    calls = {"empty": 0}

    def step_with_empty_plans_first():
        if calls["empty"] < num_empty:  # as when every request is paused for a migration
            calls["empty"] += 1
            return StepPlan(()), []
        return real_step()

    core.step = step_with_empty_plans_first
    loop = EngineLoop(core)
    runner = asyncio.create_task(loop.run())
    channel = await loop.add_request("r", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    async for _ in channel.follow():
        pass
    loop.stop()
    await runner
    loop.close()
    window = loop._step_ms
    assert window.num_empty_skipped == num_empty
    assert len(window) == core.num_steps > 0  # one entry per step that ran the model
    load = loop.load()
    assert 0 < load.itl_p50_ms <= load.itl_p99_ms
