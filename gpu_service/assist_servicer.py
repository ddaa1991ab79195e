"""The DenseAssist gRPC servicer: a thin loop over one AssistSession per stream.

Each upstream message is decoded, handed to the session and its reply encoded,
all in a worker thread (asyncio.to_thread) so device work and tensor
serialization never block the event loop. A malformed message ends the stream
with INVALID_ARGUMENT naming the field; an iteration that waited past its
max_device_wait_ms budget ends it with RESOURCE_EXHAUSTED (the client redoes the
iteration locally); the server stays ready for new streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from dualpace.errors import InvalidArgument, Overloaded
from dualpace.wire import assist_messages
from dualpace.wire.v1 import assist_pb2, assist_pb2_grpc
from gpu_service.dense_assist import AssistSession, DenseAssistExecutor


class DenseAssistServicer(assist_pb2_grpc.DenseAssistServicer):
    """Serves dualpace.v1.DenseAssist from a DenseAssistExecutor."""

    def __init__(self, executor: DenseAssistExecutor):
        self._executor = executor

    async def Assist(
        self, request_iterator: AsyncIterator[assist_pb2.AssistUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[assist_pb2.AssistDown]:
        session = self._executor.new_session()
        try:
            async for message in request_iterator:
                yield await asyncio.to_thread(_reply_to, session, message)
        except (InvalidArgument, ValueError) as exc:
            # Mapped here too so the servicer works without the status interceptor.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            session.close()  # an unfinished iteration must not keep the device lock


def _reply_to(session: AssistSession, message: assist_pb2.AssistUp) -> assist_pb2.AssistDown:
    """Decode, run one step of the session, encode (in a worker thread)."""
    return assist_messages.assist_down_to_pb(session.handle(assist_messages.assist_up_from_pb(message)))


def add_dense_assist_servicer(executor: DenseAssistExecutor, server: grpc.aio.Server) -> None:
    """Register DenseAssist on a server (use as, or inside, a daemon's register callback)."""
    assist_pb2_grpc.add_DenseAssistServicer_to_server(DenseAssistServicer(executor), server)
