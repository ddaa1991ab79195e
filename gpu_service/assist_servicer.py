"""The DenseAssist gRPC servicer: a thin loop over one AssistSession per stream.

Each upstream message is decoded, handed to the session and its reply encoded,
all in a worker of the bounded stage pool (gpu_service/assist_limits.py) so device
work and tensor serialization never block the event loop. A malformed message ends
the stream with INVALID_ARGUMENT naming the field; an iteration that waited past its
max_device_wait_ms budget ends it with RESOURCE_EXHAUSTED (the client redoes the
iteration locally); a client silent mid-iteration past the idle timeout, or a stage
past the stage timeout, ends it with DEADLINE_EXCEEDED. The session is closed (the
device lock released) in every case, and the server stays ready for new streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from dualpace.engine.worker_pools import pool
from dualpace.errors import InvalidArgument, Overloaded
from dualpace.serve.logging_setup import get_logger
from dualpace.wire import assist_messages
from dualpace.wire.v1 import assist_pb2, assist_pb2_grpc
from gpu_service.assist_limits import STAGE_POOL, AssistExpired, AssistLimits
from gpu_service.dense_assist import AssistSession, DenseAssistExecutor

log = get_logger(__name__)


class DenseAssistServicer(assist_pb2_grpc.DenseAssistServicer):
    """Serves dualpace.v1.DenseAssist from a DenseAssistExecutor."""

    def __init__(self, executor: DenseAssistExecutor, limits: AssistLimits | None = None):
        self._executor = executor
        self._limits = limits or AssistLimits(stage_timeout_s=executor.stage_timeout_s)
        self._stages = pool(STAGE_POOL, self._limits.num_stage_workers)

    async def Assist(
        self, request_iterator: AsyncIterator[assist_pb2.AssistUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[assist_pb2.AssistDown]:
        session = self._executor.new_session()
        stage: asyncio.Future | None = None
        try:
            while (message := await self._next_message(request_iterator, session)) is not None:
                stage = asyncio.get_running_loop().run_in_executor(self._stages, _reply_to, session, message)
                reply = await self._finish_stage(stage)
                stage = None
                yield reply
        except (InvalidArgument, ValueError) as exc:
            # Mapped here too so the servicer works without the status interceptor.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except AssistExpired as exc:
            log.warning("dense assist session ended", reason=str(exc))
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        finally:
            # An unfinished iteration must not keep the device lock; a stage still running in
            # its worker closes the session when it returns (never two threads in one session).
            if stage is not None and not stage.done():
                stage.add_done_callback(lambda _: session.close())
            else:
                session.close()

    async def _next_message(self, request_iterator, session: AssistSession) -> assist_pb2.AssistUp | None:
        """The client's next message (None at the end of its stream); mid-iteration, within the idle timeout."""
        if not session.in_iteration:
            return await anext(request_iterator, None)
        timeout_s = self._limits.idle_timeout_s
        try:
            return await asyncio.wait_for(anext(request_iterator, None), timeout_s)
        except TimeoutError:
            raise AssistExpired(f"the client sent nothing for {timeout_s:g} s in the middle of an iteration "
                                f"(--assist-idle-timeout-s); the session is closed") from None

    async def _finish_stage(self, stage: asyncio.Future) -> assist_pb2.AssistDown:
        timeout_s = self._limits.stage_timeout_s
        try:
            # shield: a timeout stops the wait, not the stage (a thread cannot be interrupted)
            return await asyncio.wait_for(asyncio.shield(stage), timeout_s)
        except TimeoutError:
            raise AssistExpired(f"a stage ran past the server's stage timeout of {timeout_s:g} s "
                                f"(--assist-stage-timeout-s)") from None


def _reply_to(session: AssistSession, message: assist_pb2.AssistUp) -> assist_pb2.AssistDown:
    """Decode, run one step of the session, encode (in a worker thread)."""
    return assist_messages.assist_down_to_pb(session.handle(assist_messages.assist_up_from_pb(message)))


def add_dense_assist_servicer(executor: DenseAssistExecutor, server: grpc.aio.Server,
                              limits: AssistLimits | None = None) -> None:
    """Register DenseAssist on a server (use as, or inside, a daemon's register callback)."""
    assist_pb2_grpc.add_DenseAssistServicer_to_server(DenseAssistServicer(executor, limits), server)
