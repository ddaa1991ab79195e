"""The DenseAssist gRPC servicer: a thin loop over one AssistSession per stream.

Each upstream message is decoded, handed to the session and its reply encoded,
all in a worker of the bounded stage pool (gpu_service/assist_limits.py) so device
work and tensor serialization never block the event loop. A malformed message ends
the stream with INVALID_ARGUMENT naming the field; an iteration that waited past its
max_device_wait_ms budget ends it with RESOURCE_EXHAUSTED (the client redoes the
iteration locally); a client silent mid-iteration past the idle timeout, or a stage
past the stage timeout, ends it with DEADLINE_EXCEEDED. The session is closed (the
device lock released) in every case, and the server stays ready for new streams.

A same-host client may offer a shared-memory segment first (shm_offer); once accepted,
its iterations run through the rings in the stream's own thread (gpu_service/assist_shm_session.py)
under the same rules, and this loop relays what the thread reports and what the client sends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import grpc

from dualpace.engine.transfer.worker_pools import pool
from dualpace.errors import InvalidArgument, Overloaded
from dualpace.serve.logging_setup import get_logger
from dualpace.engine.assist.assist_types import AssistQkv
from dualpace.wire import assist_messages, assist_wire
from dualpace.wire.v1 import assist_pb2, assist_pb2_grpc
from gpu_service.assist_limits import STAGE_POOL, AssistExpired, AssistLimits, idle_expired, stage_expired
from gpu_service.assist_shm_session import ShmStream, accept_offer, open_tcp
from gpu_service.dense_assist import AssistSession, DenseAssistExecutor

log = get_logger(__name__)


class DenseAssistServicer(assist_pb2_grpc.DenseAssistServicer):
    """Serves dualpace.v1.DenseAssist from a DenseAssistExecutor."""

    def __init__(self, executor: DenseAssistExecutor, limits: AssistLimits | None = None, data_socket=None):
        self._executor = executor
        self._data_socket = data_socket  # the daemon's TcpDataServer: assist from other hosts (None: gRPC only)
        self._limits = limits or AssistLimits(stage_timeout_s=executor.stage_timeout_s)
        self._stages = pool(STAGE_POOL, self._limits.num_stage_workers)
        self.num_shm_streams = 0  # streams whose rings are open now

    async def Assist(
        self, request_iterator: AsyncIterator[assist_pb2.AssistUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[assist_pb2.AssistDown | bytes]:
        session = self._executor.new_session()
        lock = threading.Lock()  # the session runs one stage at a time, from the pool or the ring thread
        stage: asyncio.Future | None = None
        shm: ShmStream | None = None
        last_stage_s: float | None = None  # how long this stream's previous stage ran (None: none yet)
        try:
            while True:
                if shm is None:
                    message = await self._next_message(request_iterator, session)
                else:
                    what, item = await shm.next_event(request_iterator)
                    if what == "reply":
                        yield item
                        continue
                    message = item
                if message is None:
                    break
                if message.WhichOneof("kind") == "shm_offer":
                    answer, shm = await self._accept(message, session, lock, shm)
                    yield answer
                    continue
                if self._stage_inline(session, message, last_stage_s):
                    reply, last_stage_s = _reply_to(session, message, lock)
                else:
                    stage = asyncio.get_running_loop().run_in_executor(self._stages, _reply_to, session, message, lock)
                    reply, last_stage_s = await self._finish_stage(stage)
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
            if shm is not None:
                self.num_shm_streams -= 1
                shm.stop()  # its thread closes the session (after any stage) and unmaps the segment
            elif stage is not None and not stage.done():
                stage.add_done_callback(lambda _: _close(session, lock))
            else:
                _close(session, lock)

    async def _accept(self, message: assist_pb2.AssistUp, session: AssistSession, lock: threading.Lock,
                      shm: ShmStream | None) -> tuple[assist_pb2.AssistDown, ShmStream | None]:
        """Answer a shm_offer; the stream's ring thread, started, when accepted."""
        if shm is not None or session.in_iteration:
            raise InvalidArgument("shm_offer", "must come before any begin, once per stream")
        offer = assist_messages.assist_up_from_pb(message)
        loop = asyncio.get_running_loop()
        answer, segment = await loop.run_in_executor(self._stages, accept_offer, offer, self._executor.model,
                                                     self._limits, self.num_shm_streams, session.accepts_join)
        joins = segment is not None
        if segment is None and offer.tcp and self._data_socket is not None and self._limits.shm_enabled \
                and self.num_shm_streams < self._limits.max_shm_streams:
            answer, segment = open_tcp(self._data_socket, answer, offer, self._executor.model, loop)
        if segment is not None:
            shm = ShmStream(session, segment, lock, self._limits, loop, self._executor.model, offer.path, joins)
            self.num_shm_streams += 1
            shm.start()
        else:
            log.info("dense assist over gRPC: shared memory refused", reason=answer.reason)
        return assist_messages.assist_down_to_pb(answer), shm

    async def _next_message(self, request_iterator, session: AssistSession) -> assist_pb2.AssistUp | None:
        """The client's next message (None at the end of its stream); mid-iteration, within the idle timeout."""
        if not session.in_iteration:
            return await anext(request_iterator, None)
        timeout_s = self._limits.idle_timeout_s
        try:
            async with asyncio.timeout(timeout_s):  # a timer on this task, not a task per message (wait_for)
                return await anext(request_iterator, None)
        except TimeoutError:
            raise idle_expired(timeout_s) from None

    def _stage_inline(self, session: AssistSession, message: assist_pb2.AssistUp, last_stage_s: float | None) -> bool:
        """Run a layer's stage on the event loop itself, saving the pool's two thread hops, when it
        cannot hold the loop long: the stream's previous stage ran within --assist-inline-stage-us and
        the session says the device is free now (the stage will not wait for it). Begins (which may wait
        for the engine's iteration) always go to the pool, as does every stage of a session that does
        not say (device_free_now) and every stage after one that ran past the bound."""
        if last_stage_s is None or last_stage_s * 1e6 > self._limits.inline_stage_us:
            return False
        device_free_now = getattr(session, "device_free_now", None)
        return (device_free_now is not None and message.WhichOneof("kind") == "attention_output"
                and device_free_now())

    async def _finish_stage(self, stage: asyncio.Future) -> tuple[assist_pb2.AssistDown | bytes, float]:
        timeout_s = self._limits.stage_timeout_s
        # asyncio.wait leaves the stage running past a timeout (a thread cannot be interrupted), and
        # wakes this task one callback after the stage ends (wait_for over shield took three)
        done, _ = await asyncio.wait((stage,), timeout=timeout_s)
        if not done:
            raise stage_expired(timeout_s)
        return stage.result()


def _reply_to(session: AssistSession, message: assist_pb2.AssistUp,
              lock: threading.Lock) -> tuple[assist_pb2.AssistDown | bytes, float]:
    """Decode, run one step of the session, encode (in a worker thread, or inline); the reply and
    how long all that took in seconds."""
    started_s = time.perf_counter()
    with lock:
        reply = session.handle(assist_messages.assist_up_from_pb(message))
        if isinstance(reply, AssistQkv):  # a layer's q/k/v: encoded by hand (dualpace/wire/assist_wire.py)
            encoded = assist_wire.encode_qkv_down(reply.iteration_id, reply.layer, reply.q, reply.k, reply.v)
        else:
            encoded = assist_messages.assist_down_to_pb(reply)
    return encoded, time.perf_counter() - started_s


def _close(session: AssistSession, lock: threading.Lock) -> None:
    with lock:
        session.close()


def add_dense_assist_servicer(executor: DenseAssistExecutor, server: grpc.aio.Server,
                              limits: AssistLimits | None = None, data_socket=None) -> None:
    """Register DenseAssist on a server (use as, or inside, a daemon's register callback).

    As the generated add_DenseAssistServicer_to_server, but replies may be pre-encoded bytes."""
    servicer = DenseAssistServicer(executor, limits, data_socket)
    handlers = {"Assist": grpc.stream_stream_rpc_method_handler(
        servicer.Assist, request_deserializer=assist_wire.parse_up,
        response_serializer=assist_wire.serialize_down)}
    service = assist_pb2.DESCRIPTOR.services_by_name["DenseAssist"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
