"""The dualpace.v1.Router servicer: thin, over RouterCore and Relay. Its Generate streams are
counted by a StreamDrain (router/draining.py), which the router drains on SIGTERM."""

from __future__ import annotations

import asyncio
import time

import grpc

from dualpace.wire import router_messages as messages
from dualpace.wire.v1 import router_pb2, router_pb2_grpc
from router.draining import StreamDrain
from router.prompts import request_id_for
from router.relay import open_request
from router.router_core import RouterCore


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore):
        self.core = core
        self.drain = StreamDrain()

    async def Generate(self, request, context):
        with self.drain.stream():
            client = messages.client_request_from_pb(request)
            request_id = request_id_for(client)
            remaining_s = context.time_remaining()  # None without a client deadline
            client_deadline = time.monotonic() + remaining_s if remaining_s is not None else None
            relay = await open_request(self.core, client, request_id, client_deadline)
            async for update in self.drain.updates(relay.run()):
                yield messages.generate_response_to_pb(
                    request_id, update.token_ids, update.text, update.engine, update.finish_reason,
                    len(relay.prompt_token_ids), len(relay.output_token_ids), relay.num_cached_tokens,
                    update.logprobs, update.prompt_logprobs)

    async def ListPlacements(self, request, context):
        pool = self.core.pool
        engines, requests = [], []

        async def list_requests(handle):
            try:
                return handle, await handle.list_requests(timeout_s=5)
            except grpc.aio.AioRpcError:
                return handle, None

        for handle, listing in await asyncio.gather(*(list_requests(h) for h in pool.handles)):
            if handle.view is not None:
                engines.append(messages.engine_placement_to_pb(handle.view, handle.healthy,
                                                               pool.prefix_index.num_blocks(handle.name)))
            for info in listing or ():
                requests.append(messages.request_placement_to_pb(handle.name, info))
        for tracked in list(self.core.tracked.values()):
            if tracked.waiting_for is not None:
                requests.append(messages.waiting_placement_to_pb(tracked.request_id, tracked.waiting_for,
                                                                 tracked.num_prompt_tokens,
                                                                 tracked.num_generated_tokens))
        return router_pb2.Placements(engines=engines, requests=requests,
                                     migrations=[messages.migration_to_pb(m) for m in self.core.migrations])
