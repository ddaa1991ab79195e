"""A grpc.aio server interceptor that turns escaping exceptions into statuses.

Every handler kind is wrapped: unary-unary, unary-stream, stream-unary and
stream-stream, both as async generators and as coroutines that write with
`context.write`. An exception raised mid-stream, after some messages were sent,
ends the stream with its status. The mapping itself is `status_for`.

What passes through untouched: `context.abort` from the servicer (its own
status stands), cancellation (asyncio.CancelledError, GeneratorExit) and
synchronous handlers (servicers here are async).

A unary request that protobuf cannot parse (a string field that is not UTF-8) reaches no
servicer: it is answered INVALID_ARGUMENT naming the field (dualpace.wire.undecodable), not
grpc's INTERNAL "Exception deserializing request!".
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc

from dualpace.errors import InvalidArgument
from dualpace.serve.metrics import error as count_error
from dualpace.serve.status import is_internal, status_for
from dualpace.wire.undecodable import UndecodableRequest, lenient_deserializer

logger = logging.getLogger(__name__)

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to gRPC statuses via `status_for`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return wrap_handler(handler, handler_call_details.method)


def wrap_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """Returns a handler of the same kind whose behavior maps exceptions to statuses."""
    if handler.request_streaming and handler.response_streaming:
        factory, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    elif handler.request_streaming:
        factory, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    elif handler.response_streaming:
        factory, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    else:
        factory, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
    deserializer = handler.request_deserializer
    if not handler.request_streaming:  # a stream's messages reach the servicer's own loop: left as they are
        deserializer = lenient_deserializer(deserializer)
    return factory(
        _wrap_behavior(behavior, method),
        request_deserializer=deserializer,
        response_serializer=handler.response_serializer,
    )


def _check_decoded(request: Any) -> None:
    if isinstance(request, UndecodableRequest):
        raise InvalidArgument(request.field, request.problem)


def _wrap_behavior(behavior: Behavior, method: str) -> Behavior:
    """Wraps an async generator or coroutine function; leaves anything else as it is.

    grpc.aio picks how to drive a handler from the function's kind, so the
    wrapper must be of the same kind as what it wraps.
    """
    if inspect.isasyncgenfunction(behavior):
        return _wrap_async_generator(behavior, method)
    if inspect.iscoroutinefunction(behavior):
        return _wrap_coroutine(behavior, method)
    return behavior


def _wrap_coroutine(behavior: Behavior, method: str) -> Behavior:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_decoded(request)
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await abort_with_status(exc, context, method)

    return call


def _wrap_async_generator(behavior: Behavior, method: str) -> Behavior:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # aclosing: a cancelled client closes the servicer's generator at once,
        # so its finally blocks (abort the request, free KV) run promptly.
        try:
            _check_decoded(request)
            async with aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await abort_with_status(exc, context, method)

    return stream


async def abort_with_status(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """Logs `exc` (with its traceback when it is a server bug) and aborts the call with its status."""
    code, message = status_for(exc)
    count_error(code.name)
    if is_internal(code):
        logger.error("%s failed: %s", method, message, exc_info=exc)
    else:
        logger.debug("%s -> %s: %s", method, code.name, message)
    await context.abort(code, message)
