"""The DenseAssist gRPC servicer: a thin loop over one AssistSession per stream.

A malformed message ends the stream with INVALID_ARGUMENT naming the field; an iteration that waited past its
max_device_wait_ms budget ends it with RESOURCE_EXHAUSTED (the client redoes the
iteration locally); a client silent mid-iteration past the idle timeout, or a stage
past the stage timeout, ends it with DEADLINE_EXCEEDED. The session is closed (the
device lock released) in every case, and the server stays ready for new streams.

A stream opens with the client's offer (shm_offer): a shared-memory segment from a client on this
host, or a request for the TCP data socket from one on another. Once accepted, its iterations run
through the rings (or the socket's frames) in the stream's own thread (gpu_service/assist_shm_session.py)
under the same rules, and this loop relays what the thread reports and what the client sends. The
per-layer tensors never go over the gRPC stream: it carries the offer, its answer, a result too large
for a slot, errors and the end.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc

from dualpace.errors import InvalidArgument, Overloaded
from dualpace.serve.logging_setup import get_logger
from dualpace.wire import assist_messages
from dualpace.wire.v1 import assist_pb2, assist_pb2_grpc
from gpu_service.assist_limits import AssistExpired, AssistLimits
from gpu_service.assist_shm_session import ShmStream, accept_offer, open_tcp
from gpu_service.dense_assist import AssistSession, DenseAssistExecutor

log = get_logger(__name__)


class DenseAssistServicer(assist_pb2_grpc.DenseAssistServicer):
    """Serves dualpace.v1.DenseAssist from a DenseAssistExecutor."""

    def __init__(self, executor: DenseAssistExecutor, limits: AssistLimits | None = None, data_socket=None):
        self._executor = executor
        self._data_socket = data_socket  # the daemon's TcpDataServer: assist from other hosts
        self._limits = limits or AssistLimits(stage_timeout_s=executor.stage_timeout_s)
        self.num_shm_streams = 0  # streams whose rings are open now

    async def Assist(
        self, request_iterator: AsyncIterator[assist_pb2.AssistUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[assist_pb2.AssistDown]:
        session = self._executor.new_session()
        lock = threading.Lock()  # the session runs one stage at a time (the ring thread's)
        shm: ShmStream | None = None
        try:
            while True:
                if shm is None:
                    message = await anext(request_iterator, None)
                else:
                    what, item = await shm.next_event(request_iterator)
                    if what == "reply":
                        yield item
                        continue
                    message = item
                if message is None:
                    break
                kind = message.WhichOneof("kind")
                if kind != "shm_offer":
                    raise InvalidArgument(kind or "kind", "an iteration runs through the rings or the data socket: "
                                                          "the stream takes only their offer (shm_offer)")
                answer, shm = await self._accept(message, session, lock, shm)
                yield answer
        except (InvalidArgument, ValueError) as exc:
            # Mapped here too so the servicer works without the status interceptor.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except AssistExpired as exc:
            log.warning("dense assist session ended", reason=str(exc))
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        finally:
            # An unfinished iteration must not keep the device lock.
            if shm is not None:
                self.num_shm_streams -= 1
                shm.stop()  # its thread closes the session (after any stage) and unmaps the segment
            else:
                _close(session, lock)

    async def _accept(self, message: assist_pb2.AssistUp, session: AssistSession, lock: threading.Lock,
                      shm: ShmStream | None) -> tuple[assist_pb2.AssistDown, ShmStream | None]:
        """Answer a shm_offer; the stream's ring thread, started, when accepted."""
        if shm is not None:
            raise InvalidArgument("shm_offer", "once per stream")
        offer = assist_messages.assist_up_from_pb(message)
        loop = asyncio.get_running_loop()
        answer, segment = await asyncio.to_thread(accept_offer, offer, self._executor.model, self._limits,
                                                  self.num_shm_streams, session.accepts_join)
        joins = segment is not None
        if segment is None and offer.tcp and self._data_socket is not None \
                and self.num_shm_streams < self._limits.max_shm_streams:
            answer, segment = open_tcp(self._data_socket, answer, offer, self._executor.model, loop)
        if segment is not None:
            shm = ShmStream(session, segment, lock, self._limits, loop, self._executor.model, offer.path, joins)
            self.num_shm_streams += 1
            shm.start()
        else:
            log.info("dense assist refused", reason=answer.reason)
        return assist_messages.assist_down_to_pb(answer), shm


def _close(session: AssistSession, lock: threading.Lock) -> None:
    with lock:
        session.close()


def add_dense_assist_servicer(executor: DenseAssistExecutor, server: grpc.aio.Server,
                              limits: AssistLimits | None = None, data_socket=None) -> None:
    """Register DenseAssist on a server (use as, or inside, a daemon's register callback)."""
    assist_pb2_grpc.add_DenseAssistServicer_to_server(DenseAssistServicer(executor, limits, data_socket), server)
