"""An import stream over the watch connection, shaped like the gRPC call the KV senders use.

SameHostKvSender drives an ImportKv stream through `write`, `read`, `cancel`, `done_writing`,
`code` and `details` (dualpace.serve.kv_transport). `WatchImportCall` gives the same over a
control stream of dualpace.engine.transfer.shm_control, so the transfer's logic (two phases, checks,
faults) is one code for both: a stream that ended before a reply reads as `grpc.aio.EOF`,
with the target's status code and details, and a write after the end raises as a write to
an ended gRPC call does. The target side is EngineServicer.import_over_watch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from dualpace.engine.transfer.same_host import SameHostRefused
from dualpace.engine.transfer.shm_control import OutgoingStream

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class WatchImportCall:
    def __init__(self, stream: OutgoingStream, parse_reply: Callable[[bytes], object]):
        self.stream = stream
        self._parse_reply = parse_reply  # bytes -> ImportKvReply (the protobuf stays in its modules)

    async def write(self, message, *more) -> None:
        """One message, or several in one send (a gRPC call's write takes one)."""
        try:
            self.stream.write(message.SerializeToString(), *(m.SerializeToString() for m in more))
        except (ConnectionError, SameHostRefused) as exc:
            raise asyncio.InvalidStateError(str(exc)) from None

    async def read(self):
        payload = await self.stream.read()
        return grpc.aio.EOF if payload is None else self._parse_reply(payload)

    def cancel(self) -> None:
        self.stream.abandon()

    async def done_writing(self) -> None:
        """Nothing to send: the target's import ends after its committed reply."""

    async def wait_for_connection(self) -> None:
        """Connected from the start (the watch connection)."""

    async def code(self) -> grpc.StatusCode | None:
        code = self.stream.code
        return None if code is None else _CODES.get(code, grpc.StatusCode.UNKNOWN)

    async def details(self) -> str:
        return self.stream.details
