"""gpu_service's side of Dense Assist through shared memory (same host only).

`accept_offer` checks a client's AssistShmOffer: shared memory enabled here, the same boot
id, and the segment at the offered path holds the offered token (dualpace/engine/assist/shm_ring.py);
then it writes its own token back and says how many rows a slot holds in this model's dtype.
Anything else is a refusal with a reason, and the stream goes on over gRPC.

`ShmStream` serves the accepted stream's ring iterations in a thread of its own, one message
at a time: a begin or an attention output comes up, the AssistSession computes its stage (under
the stream's lock, shared with the gRPC path, so a session never runs in two threads), and the
q/k/v or the result go down; a result too large for a slot goes on the stream (a slot says so).
The session's rules hold as on gRPC: the same checks (InvalidArgument), the device budget
(Overloaded), and the server's bounds: a client silent mid-iteration for the idle timeout, or a
stage running past the stage timeout (watched from the event loop), ends the stream with
DEADLINE_EXCEEDED. A ring begin that asks to join the GPU engine's step (and a server with a
JoinDesk) is handed over with a RingJoinChannel (gpu_service/join_channel.py): the engine's step
thread then does this stream's ring I/O while this thread waits in the desk, doing none itself.
Whenever the thread ends (stream over, error, cancel, the client killed) it
closes the session (device lock released) and unmaps the segment; the memfd has no name, so
nothing of it is left behind.
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from dualpace.engine.assist import shm_doorbell
from dualpace.engine.assist.assist_types import (
    AssistAttentionOutput,
    AssistQkv,
    AssistResult,
    AssistShmAnswer,
    AssistShmOffer,
    ShmSlotKind,
)
from dualpace.engine.assist.assist_tcp_link import TcpLink, slot_bytes_of_offer
from dualpace.engine.transfer.same_host import boot_id
from dualpace.engine.assist.shm_ring import ShmProtocolError, ShmSegment, SlotMessage, message_bytes
from dualpace.model.transformer import Transformer
from dualpace.wire import assist_messages
from gpu_service.assist_limits import AssistExpired, AssistLimits, idle_expired, stage_expired
from gpu_service.dense_assist import RESULT_SENT, AssistSession
from gpu_service.join_channel import RingJoinChannel, send_result

WATCHDOG_S = 0.25  # how often the event loop looks at a running stage (the stage timeout's grain)


def max_batch_rows(model: Transformer, slot_bytes: int) -> int:
    """The largest batch whose q/k/v (down) and attention output (up) fit one slot."""
    config, itemsize = model.config, model.dtype.itemsize
    widths = (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim)

    def fits(rows: int) -> bool:
        qkv = [rows * widths[0] * itemsize, rows * widths[1] * itemsize, rows * widths[1] * itemsize]
        return message_bytes(qkv) <= slot_bytes

    rows = max(0, slot_bytes // ((widths[0] + 2 * widths[1]) * itemsize))
    while rows > 0 and not fits(rows):
        rows -= 1
    return rows


def accept_offer(offer: AssistShmOffer, model: Transformer, limits: AssistLimits, num_open: int,
                 accepts_join: bool = False) -> tuple[AssistShmAnswer, ShmSegment | None]:
    """Map the offered segment if it is the client's on this host; the answer (accepts_join: this
    server's begins may join its engine's steps), and the segment."""
    def refuse(reason: str) -> tuple[AssistShmAnswer, None]:
        return AssistShmAnswer(accepted=False, reason=reason), None

    if not limits.shm_enabled:
        return refuse("this server runs with --assist-transport tcp")
    if not shm_doorbell.SUPPORTED:
        return refuse("shared-memory doorbells need Linux on x86-64")
    if num_open >= limits.max_shm_streams:
        return refuse(f"{num_open} streams already use shared memory here (the most: {limits.max_shm_streams})")
    own_boot_id = boot_id()
    if not own_boot_id or offer.boot_id != own_boot_id:
        return refuse("another host: the boot ids differ")
    try:
        segment = ShmSegment.open(offer.path, offer.size_bytes, offer.token)
    except (OSError, ShmProtocolError) as exc:
        return refuse(f"cannot map the offered segment: {exc}")
    rows = max_batch_rows(model, segment.slot_bytes)
    if rows < 1:
        segment.close()
        return refuse(f"a slot of {segment.slot_bytes} bytes holds no row of this model")
    return AssistShmAnswer(accepted=True, token=segment.server_token, max_batch_rows=rows,
                           accepts_join=accepts_join), segment


def open_tcp(data_socket, refused: AssistShmAnswer, offer: AssistShmOffer, model: Transformer,
             loop: asyncio.AbstractEventLoop) -> tuple[AssistShmAnswer, TcpLink | None]:
    """The segment refused (another host) and the client takes a data socket: a one-time ticket on
    the daemon's TcpDataServer, the answer that names it, and the link that waits for the connection."""
    slot_bytes = slot_bytes_of_offer(offer.size_bytes)
    rows = max_batch_rows(model, slot_bytes)
    if rows < 1:
        return refused, None
    ticket, pending = data_socket.open()
    link = TcpLink(slot_bytes, pending=pending, loop=loop, revoke=lambda: data_socket.revoke(ticket))
    return AssistShmAnswer(accepted=False, reason=refused.reason, max_batch_rows=rows, tcp_port=data_socket.port,
                           tcp_ticket=ticket, tcp_tls=data_socket.tls is not None), link


class ShmStream:
    """The ring side of one stream: a thread that serves ring messages, watched from the event loop."""

    def __init__(self, session: AssistSession, segment: ShmSegment, lock: threading.Lock, limits: AssistLimits,
                 loop: asyncio.AbstractEventLoop, model: Transformer, peer: str = "", joins: bool = True):
        self._session = session
        self._model = model
        self._peer = peer  # names the client in step timelines (the offer's path: its pid and memfd)
        self._joins = joins  # begins may join the engine's step (shared memory only, not a TcpLink)
        session.host_outputs = False  # q/k/v go from the device straight into the slot: one copy
        self._segment = segment
        self._endpoint = segment.endpoint("down", shm_doorbell.DEFAULT_SPIN_S)
        self._lock = lock
        self._limits = limits
        self._loop = loop
        self.ended: asyncio.Future = loop.create_future()  # None: stopped; else the thread's error
        self.outbox: asyncio.Queue = asyncio.Queue()  # AssistDown messages for the stream
        self._outbox_get: asyncio.Future | None = None
        self._upstream: asyncio.Future | None = None
        self._stop = threading.Event()
        self._mapped = threading.Lock()  # stop()'s wake-up vs the thread's unmapping
        self._stage_started_s: float | None = None
        self._segment_closed = False
        self._ring_iteration = False  # a ring begin was answered; its result is not sent yet
        self._last_upstream_s = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="assist-shm", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it closes the session and unmaps); safe to call more than once."""
        self._stop.set()
        with self._mapped:
            if not self._segment_closed:
                self._endpoint.incoming.interrupt()
        for pending in (self._upstream, self._outbox_get):
            if pending is not None:
                pending.cancel()

    async def next_event(self, request_iterator) -> tuple[str, object]:
        """("message", AssistUp or None at the stream's end) from the client, or ("reply", AssistDown)
        to send; raises the thread's error, or AssistExpired for a stage or a client past its bound."""
        while True:
            if self._upstream is None:
                self._upstream = asyncio.ensure_future(anext(request_iterator, None))
            if self._outbox_get is None:
                self._outbox_get = asyncio.ensure_future(self.outbox.get())
            await asyncio.wait({self._upstream, self._outbox_get, self.ended}, timeout=WATCHDOG_S,
                               return_when=asyncio.FIRST_COMPLETED)
            if self._outbox_get.done():
                reply, self._outbox_get = self._outbox_get.result(), None
                return "reply", reply
            if self.ended.done():
                self.ended.result()  # the thread's error, if any
                raise AssistExpired("the shared-memory session ended")
            if self._upstream.done():
                message, self._upstream = self._upstream.result(), None
                self._last_upstream_s = time.monotonic()
                return "message", message
            self._check_bounds()

    def _check_bounds(self) -> None:
        now_s = time.monotonic()
        started_s = self._stage_started_s
        if started_s is not None and now_s - started_s > self._limits.stage_timeout_s:
            raise stage_expired(self._limits.stage_timeout_s)
        idle_s = self._limits.idle_timeout_s
        if self._session.in_iteration and not self._ring_iteration and now_s - self._last_upstream_s > idle_s:
            raise idle_expired(idle_s)

    # ---- the thread ---------------------------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            # The whole thread in inference mode, as the engine's step thread: a tensor one of them
            # made there (a staged iteration's rows, a join's) may be updated in place by the other,
            # and torch refuses an in-place update of an inference tensor outside inference mode.
            with torch.inference_mode():
                self._serve()
        except BaseException as exc:  # reported to the event loop, which ends the stream with its status
            error = exc
        finally:
            with self._lock:
                self._session.close()
            with self._mapped:
                self._segment_closed = True
                self._segment.close()
            try:
                self._loop.call_soon_threadsafe(self._finish, error)
            except RuntimeError:
                pass  # the event loop is gone (server shut down)

    def _finish(self, error: BaseException | None) -> None:
        if not self.ended.done():
            if error is None or self._stop.is_set():  # stopped: the stream is over, nobody reads the error
                self.ended.set_result(None)
            else:
                self.ended.set_exception(error)

    def _serve(self) -> None:
        idle_s = self._limits.idle_timeout_s
        while not self._stop.is_set():
            deadline_s = time.monotonic() + idle_s if self._ring_iteration else None
            message = self._endpoint.receive(deadline_s, self._stop.is_set)
            if message is None:
                if self._stop.is_set():
                    return
                raise idle_expired(idle_s)
            self._stage_started_s = time.monotonic()
            try:
                with self._lock:
                    reply = self._handle(message)
            finally:
                self._stage_started_s = None
            self._send(reply)

    def _handle(self, message: SlotMessage) -> AssistQkv | AssistResult | object:
        if message.kind == ShmSlotKind.BEGIN and not message.tensors:
            begin = assist_messages.begin_from_bytes(message.payload)
            channel = None
            if begin.join_engine_iteration and self._session.accepts_join and self._joins:
                # the step thread drives the ring through it while this thread waits in the desk
                channel = RingJoinChannel(self._endpoint, self._model, begin, self._stop.is_set, self._put_on_stream,
                                          self._peer)
            reply = self._session.begin(begin, channel)
            self._ring_iteration = reply is not RESULT_SENT
            return reply
        if message.kind == ShmSlotKind.ATTENTION_OUTPUT and len(message.tensors) == 1:
            reply = self._session.attention_output(
                AssistAttentionOutput(message.iteration_id, message.layer, message.tensors[0]))
            if isinstance(reply, AssistResult):
                self._ring_iteration = False
            return reply
        raise ShmProtocolError(f"slot.kind: {message.kind} with {len(message.tensors)} tensors is not an upstream message")

    def _send(self, reply: AssistQkv | AssistResult | object) -> None:
        if reply is RESULT_SENT:  # a joined step sent it through the ring already
            return
        if isinstance(reply, AssistQkv):
            self._endpoint.send_parts(ShmSlotKind.QKV, reply.iteration_id, reply.layer, (reply.q, reply.k, reply.v))
        else:
            send_result(self._endpoint, reply, self._put_on_stream)

    def _put_on_stream(self, pb) -> None:
        """An AssistDown for the gRPC stream (a result too large for a slot), from any thread."""
        self._loop.call_soon_threadsafe(self.outbox.put_nowait, pb)
