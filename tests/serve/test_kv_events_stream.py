"""WatchKvEvents' generator on an in-process engine loop: events as blocks fill, and the stream
ends when the engine stops (a read pending at that moment must not hang shutdown)."""

from __future__ import annotations

import asyncio

import pytest

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.errors import FailedPrecondition
from dualpace.kv.events import ALL_CLEARED, STORED
from dualpace.sampling import SamplingParams
from dualpace.serve.kv_events_stream import watch_kv_events
from tests.helpers import until


async def test_stream_reports_stored_blocks_and_ends_with_the_engine(tiny):
    loop = EngineLoop(EngineCore(tiny, EngineConfig(num_kv_blocks=32, block_size=4)))
    task = asyncio.create_task(loop.run())
    stream = watch_kv_events(loop, poll_s=0.01)
    first = await anext(stream)
    assert [e.kind for e in first] == [ALL_CLEARED]
    channel = await loop.add_request("a", list(range(3, 12)), SamplingParams(max_tokens=2, ignore_eos=True))
    async for _ in channel.follow():
        pass
    batch = await anext(stream)
    assert batch[0].kind == STORED and list(batch[0].token_ids) == list(range(3, 11))  # the prompt's two full blocks
    # A read pending inside the generator's polling (it has asked the log again) when the loop stops.
    log = loop.core.scheduler.prefix_cache.events
    asked, since = [], log.since
    log.since = lambda last_id: asked.append(last_id) or since(last_id)
    pending = asyncio.ensure_future(anext(stream))
    await until(lambda: asked, "the generator polls the log again")
    loop.stop()
    await task
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, 30)  # bounded: a hang would fail here, not stall the suite
    loop.close()


async def test_no_stream_without_prefix_caching(tiny):
    loop = EngineLoop(EngineCore(tiny, EngineConfig(num_kv_blocks=8, block_size=4, prefix_caching=False)))
    with pytest.raises(FailedPrecondition):
        await anext(watch_kv_events(loop))
    loop.close()
