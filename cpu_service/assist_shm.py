"""The CPU engine's side of Dense Assist through shared memory (same host only).

On a fresh stream the client offers a segment (dualpace/engine/assist/shm_ring.py): its boot id,
the memfd's /proc path, its size and a random token. When gpu_service maps it, finds the
token and writes its own (checked here), every iteration runs through the rings: the begin goes
up as bytes, each layer's q/k/v come down and the attention output goes up as tensors in place,
the result comes down; the gRPC stream stays open for errors and the end. On another host the same
messages go as frames over gpu_service's TCP data socket (a TcpLink in the segment's place). Any
failure raises AssistUnavailable: the engine redoes the iteration locally and the next one opens a
fresh stream (and a fresh segment).

A gRPC reply arriving while this side waits on the ring (the server ended the stream with a
status) wakes the wait at once (`interrupt`): nothing waits out a timeout for a dead peer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from dualpace.engine.assist import ring_pacing, shm_doorbell
from dualpace.engine.assist.assist_types import (
    AssistBegin,
    AssistJoinInfo,
    AssistResult,
    AssistShmAnswer,
    AssistShmOffer,
    ShmSlotKind,
)
from dualpace.engine.transfer.same_host import boot_id
from dualpace.engine.assist.shm_ring import ShmEndpoint, ShmProtocolError, ShmSegment, message_bytes, segment_bytes
from dualpace.wire import assist_messages

NUM_SLOTS = 2  # one iteration's messages alternate down and up: two slots a direction suffice
TRANSPORTS = ("auto", "tcp")  # tcp: never shared memory, the data socket

# (layer, q, k, v) -> attention output [batch, num_heads * head_dim]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def slot_bytes_for(max_batch_rows: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """A slot that holds q/k/v (or the attention output) of max_batch_rows rows in float32."""
    qkv_bytes = [max_batch_rows * heads * head_dim * 4 for heads in (num_heads, num_kv_heads, num_kv_heads)]
    return -(-message_bytes(qkv_bytes, 4096) // 4096) * 4096


def new_offer(slot_bytes: int) -> tuple[ShmSegment, AssistShmOffer] | None:
    """A fresh segment and its offer (the data socket is welcome where it is refused); None where
    this process cannot share memory (not Linux x86-64)."""
    host = boot_id()
    if not shm_doorbell.SUPPORTED or not host:
        return None
    segment = ShmSegment.create(NUM_SLOTS, slot_bytes)
    return segment, AssistShmOffer(boot_id=host, path=segment.peer_path, size_bytes=segment.size_bytes,
                                   token=segment.client_token, tcp=True)


def tcp_only_offer(slot_bytes: int) -> AssistShmOffer:
    """An offer with no segment (no boot id: the server refuses it) that asks for the data socket;
    its size tells the server the frame size (that of a segment of these slots)."""
    return AssistShmOffer(boot_id="", path="", size_bytes=segment_bytes(NUM_SLOTS, slot_bytes), token=b"", tcp=True)


class ShmIterations:
    """The rings of one accepted stream, client side (one iteration at a time)."""

    def __init__(self, segment, answer: AssistShmAnswer, spin_s: float):
        self._segment = segment  # a ShmSegment, or a TcpLink (dualpace/engine/assist/assist_tcp_link.py)
        self._endpoint: ShmEndpoint = segment.endpoint("up", spin_s)
        self.over_tcp = not isinstance(segment, ShmSegment)
        self.max_batch_rows = answer.max_batch_rows
        self.accepts_join = answer.accepts_join  # begins through these rings may join the GPU engine's step
        self._lock = threading.Lock()  # interrupt (reader thread) vs close
        self._closed = False

    def fits(self, batch: int, begin_bytes: bytes) -> bool:
        return batch <= self.max_batch_rows and self._endpoint.fits([], len(begin_bytes))

    def run(self, begin: AssistBegin, begin_bytes: bytes, attend: AttendFn, deadline_s: float,
            stream_ended: Callable[[], bool], errors) -> AssistResult | None:
        """One iteration through the rings. Returns the result, or None when it comes on the gRPC
        stream (the caller reads it there). `stream_ended()` is true once the stream has ended (the
        caller reads why from it); `errors` builds AssistUnavailable."""
        try:
            return self._run(begin, begin_bytes, attend, deadline_s, stream_ended, errors)
        except ShmProtocolError as exc:  # a data socket's send failed (TcpLinkError)
            raise errors.protocol(str(exc)) from None

    def _run(self, begin: AssistBegin, begin_bytes: bytes, attend: AttendFn, deadline_s: float,
             stream_ended: Callable[[], bool], errors) -> AssistResult | None:
        endpoint = self._endpoint
        iteration_id = begin.iteration_id
        endpoint.send_parts(ShmSlotKind.BEGIN, iteration_id, 0, (), begin_bytes)
        batch = len(begin.token_ids)
        expected_layer = 0
        checked_qkv: dict[int, tuple] = {}  # the slot view tuples whose shapes were checked (held: ids stay theirs)
        receive, send_parts = endpoint.receive, endpoint.send_parts
        qkv_kind, output_kind = ShmSlotKind.QKV, ShmSlotKind.ATTENTION_OUTPUT
        # the answer carries when this side saw the q/k/v and when it answered (ring_pacing.py)
        monotonic_ns, pack_stamp = time.monotonic_ns, ring_pacing.OUTPUT_STAMP.pack
        while True:
            try:
                message = receive(deadline_s, stream_ended)
            except ShmProtocolError as exc:
                raise errors.protocol(str(exc)) from None
            if message is None:
                if stream_ended():
                    return None  # the stream has the answer: the status it ended with
                raise errors.timeout()
            if message.iteration_id != iteration_id:
                raise errors.protocol(f"slot for iteration {message.iteration_id}, expected {iteration_id}")
            if message.kind == qkv_kind:
                tensors = message.tensors
                if message.layer != expected_layer or (id(tensors) not in checked_qkv and not _qkv_fits(tensors, batch)):
                    raise errors.protocol(f"unexpected qkv slot for layer {message.layer} "
                                          f"(expected layer {expected_layer})")
                checked_qkv[id(tensors)] = tensors
                seen_ns = monotonic_ns()
                q, k, v = tensors
                output = attend(expected_layer, q, k, v)
                posted_ns = monotonic_ns()
                send_parts(output_kind, iteration_id, expected_layer, (output,), pack_stamp(seen_ns, posted_ns))
                expected_layer += 1
            elif message.kind == ShmSlotKind.RESULT_TOKENS and len(message.tensors) == 1:
                return AssistResult(begin.iteration_id, token_ids=message.tensors[0].tolist(),
                                    join_info=_join_info(message.payload, errors))
            elif message.kind == ShmSlotKind.RESULT_LOGITS and len(message.tensors) == 1:
                return AssistResult(begin.iteration_id, logits=message.tensors[0].clone(),
                                    join_info=_join_info(message.payload, errors))
            elif message.kind == ShmSlotKind.RESULT_ON_STREAM:
                return None
            else:
                raise errors.protocol(f"unexpected slot of kind {message.kind}")

    def interrupt(self) -> None:
        """From the stream's reader thread: wake a wait on the ring (the stream has news)."""
        with self._lock:
            if not self._closed:
                self._endpoint.incoming.interrupt()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._segment.close()


def _qkv_fits(tensors, batch: int) -> bool:
    """q, k, v of this batch: three 3-d tensors of `batch` rows."""
    return len(tensors) == 3 and all(t.dim() == 3 and t.shape[0] == batch for t in tensors)


def _join_info(payload: bytes, errors) -> AssistJoinInfo | None:
    """A result slot's payload: how the iteration ran (empty from older servers)."""
    try:
        return assist_messages.join_info_from_bytes(payload)
    except ValueError as exc:
        raise errors.protocol(str(exc)) from None


def deadline_after(budget_s: float) -> float:
    return time.monotonic() + max(budget_s, 0.0)
