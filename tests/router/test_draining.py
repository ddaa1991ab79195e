"""StreamDrain's cancel when the grace is over, without gRPC: `generate` stands for the
servicer's Generate (an async generator inside drain.stream()) and `serve` for gRPC's code
that drives it and writes each item. A stream must end with UNAVAILABLE and the reason
wherever its task is when cancel_streams runs, and its source must be closed (the relay's
clean-up aborts the engine request there)."""

from __future__ import annotations

import asyncio

import pytest

from dualpace.errors import Unavailable
from router.draining import StreamDrain

REASON = "router is shutting down and its grace of 0.5 s is over"
HANG_GUARD_S = 5.0


class Source:
    """The relay's updates: one item, then each next one when `more` is set."""

    def __init__(self) -> None:
        self.more = asyncio.Event()
        self.waiting = asyncio.Event()  # set while it waits for `more`
        self.closed = False

    async def run(self):
        try:
            yield 0
            for item in range(1, 1000):
                self.waiting.set()
                await self.more.wait()
                self.waiting.clear()
                self.more.clear()
                yield item
        finally:
            self.closed = True


def generate(drain: StreamDrain, source: Source):
    async def stream():
        with drain.stream():
            async for item in drain.updates(source.run()):
                yield item
    return stream()


async def serve(drain: StreamDrain, source: Source, writing: asyncio.Event, written: list[int]) -> BaseException | None:
    """gRPC's part: asks for items and writes each (waiting on `writing` when it is clear)."""
    try:
        async for item in generate(drain, source):
            written.append(item)
            await writing.wait()
    except Unavailable as exc:
        return exc
    return None


async def first_item_written(task: asyncio.Task, written: list[int]) -> None:
    """Waits (bounded) until gRPC's part has written the first item."""
    for _ in range(1000):
        if written or task.done():
            break
        await asyncio.sleep(0.001)
    assert written, task.exception() if task.done() else "no item in 1 s"


async def test_a_stream_cancelled_while_grpc_writes_ends_with_the_reason_at_its_next_item() -> None:
    drain, source, writing, written = StreamDrain(), Source(), asyncio.Event(), []
    task = asyncio.create_task(serve(drain, source, writing, written))
    await first_item_written(task, written)
    # The task is inside gRPC's write now: a cancel delivered there would not reach the stream.
    assert drain.cancel_streams(REASON) == 1
    writing.set()
    error = await asyncio.wait_for(task, 5)
    assert isinstance(error, Unavailable) and REASON in str(error)
    assert written == [0] and source.closed
    assert await drain.wait_drained(0)


async def test_a_stream_waiting_for_its_next_item_ends_at_once() -> None:
    drain, source, writing, written = StreamDrain(), Source(), asyncio.Event(), []
    writing.set()
    task = asyncio.create_task(serve(drain, source, writing, written))
    await first_item_written(task, written)
    await asyncio.wait_for(source.waiting.wait(), HANG_GUARD_S)  # now inside the source
    assert drain.cancel_streams(REASON) == 1
    error = await asyncio.wait_for(task, 5)
    assert isinstance(error, Unavailable) and REASON in str(error)
    assert source.closed and await drain.wait_drained(0)


async def test_a_client_that_goes_away_stays_a_cancellation() -> None:
    drain, source, writing, written = StreamDrain(), Source(), asyncio.Event(), []
    writing.set()
    task = asyncio.create_task(serve(drain, source, writing, written))
    await first_item_written(task, written)
    await asyncio.wait_for(source.waiting.wait(), HANG_GUARD_S)
    task.cancel()  # gRPC cancels the call: no reason, so no UNAVAILABLE
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.closed and await drain.wait_drained(0)


async def test_new_streams_are_refused_while_draining() -> None:
    drain = StreamDrain()
    drain.start_draining()
    with pytest.raises(Unavailable):
        async for _ in generate(drain, Source()):
            pass
