"""The dualpace.v1.Router servicer: thin, over RouterCore and Relay.

It also counts the Generate streams it is relaying, so that on SIGTERM the router can
drain them while its gRPC server keeps answering (health NOT_SERVING, new Generate
calls UNAVAILABLE) and stop the server only once they are done (router/__main__.py).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from dualpace.errors import InvalidArgument, Unavailable
from dualpace.wire import router_messages as messages
from dualpace.wire.v1 import engine_pb2, router_pb2, router_pb2_grpc
from router.core import RouterCore
from router.prompts import prepare_prompt, request_id_for
from router.relay import Relay


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore):
        self.core = core
        self.draining = False
        self._num_streams = 0
        self._idle = asyncio.Event()  # set while no Generate stream is running
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()  # the tasks running Generate streams
        self._cancel_reason: str | None = None  # set by cancel_streams

    @property
    def num_streams(self) -> int:
        """Generate calls running now (admitted, queued or relaying)."""
        return self._num_streams

    def start_draining(self) -> None:
        """From now on new Generate calls are refused with UNAVAILABLE; running ones go on."""
        self.draining = True

    async def wait_drained(self, timeout_s: float) -> bool:
        """Waits up to timeout_s for every running Generate stream to end; whether they did."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return self._idle.is_set()
        return True

    def cancel_streams(self, reason: str) -> int:
        """Ends every running Generate stream with UNAVAILABLE `reason` (their engine requests
        are aborted); returns how many there were."""
        self._cancel_reason = reason
        for task in self._tasks:
            task.cancel()
        return len(self._tasks)

    async def Generate(self, request, context):
        if self.draining:
            raise Unavailable("router is shutting down; send new requests elsewhere")
        task = asyncio.current_task()
        self._tasks.add(task)
        self._num_streams += 1
        self._idle.clear()
        try:
            client = messages.client_request_from_pb(request)
            request_id = request_id_for(client)
            if request_id in self.core.tracked:
                raise InvalidArgument("request_id", f"request {request_id!r} is already running")
            prompt_ids, params = prepare_prompt(client, self.core.tokenizer, self.core.model_config)
            remaining_s = context.time_remaining()  # None without a client deadline
            client_deadline = time.monotonic() + remaining_s if remaining_s is not None else None
            relay = Relay(self.core, request_id, prompt_ids, params, client_deadline)
            async for update in relay.run():
                yield messages.generate_response_to_pb(
                    request_id, update.token_ids, update.text, update.engine, update.finish_reason,
                    len(prompt_ids), len(relay.output_token_ids))
        except asyncio.CancelledError:
            if self._cancel_reason is None:  # the client went away, or gRPC cancelled the call
                raise
            raise Unavailable(self._cancel_reason) from None
        finally:
            self._tasks.discard(task)
            self._num_streams -= 1
            if self._num_streams == 0:
                self._idle.set()

    async def ListPlacements(self, request, context):
        pool = self.core.pool
        engines, requests = [], []

        async def list_requests(handle):
            try:
                return handle, await handle.stub.ListRequests(engine_pb2.ListRequestsRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return handle, None

        for handle, listing in await asyncio.gather(*(list_requests(h) for h in pool.handles)):
            if handle.view is not None:
                engines.append(messages.engine_placement_to_pb(handle.view, handle.healthy))
            for info in listing.requests if listing is not None else ():
                requests.append(messages.request_placement_to_pb(handle.name, info))
        return router_pb2.Placements(engines=engines, requests=requests,
                                     migrations=[messages.migration_to_pb(m) for m in self.core.migrations])
