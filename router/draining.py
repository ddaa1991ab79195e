"""The router's running Generate streams, for a drain on SIGTERM: count them, refuse new ones
once draining, wait for the running ones, and end the rest with a reason when the grace is over.
The gRPC server keeps answering meanwhile (health NOT_SERVING, new calls UNAVAILABLE), and is
stopped only once they are done (router/__main__.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager

from dualpace.errors import Unavailable


class StreamDrain:
    def __init__(self) -> None:
        self.draining = False
        self._idle = asyncio.Event()  # set while no stream is running
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()  # the tasks running streams
        self._yielded: set[asyncio.Task] = set()  # of those, the ones gRPC runs (see updates)
        self._cancel_reason: str | None = None  # set by cancel_streams

    @property
    def num_streams(self) -> int:
        """Streams running now (admitted, queued or relaying)."""
        return len(self._tasks)

    def start_draining(self) -> None:
        """From now on new streams are refused with UNAVAILABLE; running ones go on."""
        self.draining = True

    @contextmanager
    def stream(self) -> Iterator[None]:
        """Around one stream, in its own task: refused while draining; a cancel_streams ends it
        with UNAVAILABLE and the reason (a client that went away stays a cancellation)."""
        if self.draining:
            raise Unavailable("router is shutting down; send new requests elsewhere")
        task = asyncio.current_task()
        self._tasks.add(task)
        self._idle.clear()
        try:
            yield
        except asyncio.CancelledError:
            if self._cancel_reason is None:  # the client went away, or gRPC cancelled the call
                raise
            raise Unavailable(self._cancel_reason) from None
        finally:
            self._tasks.discard(task)
            if not self._tasks:
                self._idle.set()

    async def updates(self, source: AsyncGenerator):
        """`source`'s items, for a stream's task inside stream(): ends the stream with the
        cancel reason at the first item after cancel_streams.

        Between two items a stream's task runs gRPC's code (writing the last item), and a
        cancel delivered there would reach gRPC, not the stream: the call would stay open until
        the server stopped, and the client would read gRPC's "Cancelling all calls" instead of
        the reason. So cancel_streams leaves such a task alone, and it ends here when gRPC asks
        for its next item."""
        task = asyncio.current_task()
        try:
            while True:
                if self._cancel_reason is not None:
                    raise Unavailable(self._cancel_reason)
                try:
                    item = await anext(source)
                except StopAsyncIteration:
                    return
                self._yielded.add(task)
                try:
                    yield item
                finally:
                    self._yielded.discard(task)
        finally:
            await source.aclose()  # its clean-up (e.g. the engine request aborted) now, not when collected

    async def wait_drained(self, timeout_s: float) -> bool:
        """Waits up to timeout_s for every running stream to end; whether they did."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return self._idle.is_set()
        return True

    def cancel_streams(self, reason: str) -> int:
        """Ends every running stream with UNAVAILABLE `reason`: now if it is in its own code,
        else when gRPC asks for its next item (see updates). Returns how many there were."""
        self._cancel_reason = reason
        for task in self._tasks - self._yielded:
            task.cancel()
        return len(self._tasks)
