"""One open Dense Assist call, read by its caller (cpu_service/assist_client.py's transport).

A queue feeds the call's requests (gRPC's sync stub sends them from its own consumer thread);
the caller reads each reply itself on its own thread, as it waits for it anyway (no reader
thread, so no extra wake-up per reply). Reading on the caller's thread has no timeout of its own, so a watchdog thread cancels the call
when a read outlives its timeout. It is woken only when a read starts while it is idle (it
then sleeps until that read's deadline, and finds a later read's deadline when it wakes), so a
stream in use costs it about one wake-up per timeout period, not one per layer.

`ended` is set, and `on_end` called, when the call is over (gRPC's done callback), which the
shared-memory path watches while it waits on its ring instead of the stream.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from dualpace.errors import Unavailable

_END_OF_REQUESTS = object()


class AssistUnavailable(Unavailable):
    """Dense Assist could not finish this iteration; run it locally.

    code is the gRPC status code when the server ended the stream, else None
    (timeout, protocol error).
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class AssistStream:
    """One open Assist call; send from any thread, receive from one."""

    def __init__(self, assist: grpc.StreamStreamMultiCallable, address: str,
                 metadata: tuple[tuple[str, str], ...] = ()):
        self._address = address
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.ended = threading.Event()  # the call is over
        self.on_end: Callable[[], None] | None = None
        self._watch = threading.Condition()
        self._deadline_s: float | None = None  # the read in progress must end by then
        self._watcher_idle = False
        self._watching_until_s: float | None = None  # the deadline the watchdog sleeps until
        self._timed_out = False
        self._closed = False
        self._call = assist(self._request_iterator(), metadata=metadata)
        self._call.add_done_callback(self._done)
        threading.Thread(target=self._watch_reads, name="assist-read-watchdog", daemon=True).start()

    def _request_iterator(self) -> Iterator[object]:
        while True:
            message = self._requests.get()
            if message is _END_OF_REQUESTS:
                return
            yield message

    def _done(self, _call) -> None:
        self.ended.set()
        on_end = self.on_end
        if on_end is not None:
            on_end()

    def send(self, message) -> None:
        """An AssistUp."""
        self._requests.put(message)

    def receive(self, timeout_s: float):
        """The next AssistDown; AssistUnavailable when none comes within timeout_s or the call ended."""
        with self._watch:
            deadline_s = self._deadline_s = time.monotonic() + max(timeout_s, 0.0)
            if self._watcher_idle or (self._watching_until_s is not None and deadline_s < self._watching_until_s):
                self._watch.notify()
        try:
            return next(self._call)
        except StopIteration:
            raise AssistUnavailable(f"dense assist at {self._address}: the server ended the stream") from None
        except grpc.RpcError as exc:
            if self._timed_out:
                raise AssistUnavailable(
                    f"dense assist at {self._address}: no reply within the iteration timeout") from None
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            name = code.name if code is not None else "error"
            raise AssistUnavailable(f"dense assist at {self._address}: {name}: {details}", code) from None
        finally:
            with self._watch:
                self._deadline_s = None

    def _watch_reads(self) -> None:
        with self._watch:
            while not self._closed:
                deadline_s = self._deadline_s
                if deadline_s is None:
                    self._watcher_idle = True
                    self._watch.wait()  # until a read starts, or close
                    self._watcher_idle = False
                    continue
                remaining_s = deadline_s - time.monotonic()
                if remaining_s > 0:
                    self._watching_until_s = deadline_s
                    self._watch.wait(remaining_s)
                    self._watching_until_s = None
                    continue
                self._timed_out = True
                break
        if self._timed_out:
            self._call.cancel()  # the read raises; the stream is dropped by its client

    def close(self) -> None:
        """Half-close (ends the request iterator) and cancel; idempotent."""
        with self._watch:
            self._closed = True
            self._watch.notify()
        self._requests.put(_END_OF_REQUESTS)
        self._call.cancel()
