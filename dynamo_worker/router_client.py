"""The worker's typed async client of its node's router (dualpace.v1.Router over grpc.aio).

Protobuf stays here and in dualpace.wire; the worker sees plain dicts (the wire's
generate_response_to_dict / placements_to_dict) and RouterError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from dualpace.client_request import ClientRequest
from dualpace.sampling_params import SamplingParams
from dualpace.serve.auth import aio_token_interceptors
from dualpace.serve.server import channel_options
from dualpace.wire.router_messages import client_request_to_pb, generate_response_to_dict, placements_to_dict
from dualpace.wire.v1 import router_pb2, router_pb2_grpc


class RouterError(Exception):
    """A call to the router failed: the gRPC status code's name and its details."""

    def __init__(self, code_name: str, details: str):
        super().__init__(f"{code_name}: {details}")
        self.code_name = code_name
        self.details = details


def _error(exc: grpc.aio.AioRpcError) -> RouterError:
    code = exc.code()
    return RouterError(code.name if code is not None else "UNKNOWN", exc.details() or "")


class RouterClient:
    def __init__(self, address: str, auth_token: str | None = None):
        self.address = address
        self.channel = grpc.aio.insecure_channel(
            address, options=[*channel_options(), ("grpc.max_reconnect_backoff_ms", 1000)],
            interceptors=aio_token_interceptors(auth_token))
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[dict]:
        """Stream the router's pieces (token_ids, engine, finish_reason, usage). Closing the
        generator, or cancel(request_id), cancels the call, and the router aborts the request."""
        message = client_request_to_pb(ClientRequest(request_id=request_id, text=None,
                                                     prompt_token_ids=prompt_token_ids, messages=None, params=params))
        call = self.stub.Generate(message)
        self._calls[request_id] = call
        try:
            async for response in call:
                yield generate_response_to_dict(response)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        finally:
            self._calls.pop(request_id, None)
            call.cancel()  # a no-op once the stream has ended

    def cancel(self, request_id: str) -> bool:
        call = self._calls.get(request_id)
        return call.cancel() if call is not None else False

    async def placements(self, timeout_s: float = 5.0) -> dict:
        try:
            return placements_to_dict(await self.stub.ListPlacements(router_pb2.ListPlacementsRequest(),
                                                                     timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None

    async def wait_ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        except TimeoutError:
            raise RouterError("UNAVAILABLE", f"router {self.address} not reachable within {timeout_s:.0f} s") from None

    async def close(self) -> None:
        await self.channel.close()
