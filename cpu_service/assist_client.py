"""The CPU engine's client for GPU Dense Assist (synchronous, for the engine's worker thread).

    client = AssistClient("127.0.0.1:50051", iteration_timeout_s=2.0)
    token_ids = client.run_iteration(token_ids, positions, attend, sampling)

`attend(layer, q, k, v)` is called once per layer with that layer's q
[B, num_heads, head_dim] and k, v [B, num_kv_heads, head_dim] (RoPE applied,
CPU tensors in the GPU model's dtype). It appends k and v to the host KV and
returns the attention output [B, num_heads * head_dim]; the client sends it
back and waits for the next layer.

One bidirectional stream is opened lazily and reused across iterations. When
the server is unreachable, does not reply in time, ends the stream or sends
something unexpected, run_iteration raises AssistUnavailable and drops the
stream; the engine redoes the iteration locally (the KV rows attend appended
for this iteration are rewritten by the redo: same slots, same positions),
and the next run_iteration opens a fresh stream. An exception raised by
`attend` itself also drops the stream and propagates unchanged.

Each fresh stream opens with an offer (cpu_service/assist_shm.py). With transport "auto" (the
default) it is a shared-memory segment: where gpu_service is on the same host and maps it, the
iterations run through its rings; on another host gpu_service answers with its TCP data socket, and
the same messages go as frames on a TCP connection to it (dualpace/engine/assist/assist_tcp_link.py;
"tcp" asks for that path even on one host). The gRPC stream carries only the offer, its answer, a
result too large for a slot, errors and the end: where neither path is granted, or a batch does not
fit a slot, run_iteration raises AssistUnavailable and the iteration runs locally. In `attend` the
q/k/v are valid until attend returns (views into the segment, or into the link's frame).
"""

from __future__ import annotations

import itertools
import ssl
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import torch

from cpu_service import assist_shm
from cpu_service.assist_join import NO_JOIN, JoinAsk, JoinDowngrades
from cpu_service.assist_stream import AssistStream, AssistUnavailable  # noqa: F401 - AssistUnavailable is this module's API
from dualpace.engine.assist import assist_types
from dualpace.engine.transfer import kv_tcp_data
from dualpace.engine.assist.assist_tcp_link import TcpLink, slot_bytes_of_offer
from dualpace.errors import InvalidArgument
from dualpace.sampling import SamplingParams, sample_next_tokens
from dualpace.serve.address import data_socket_peer_host
from dualpace.serve.auth import token_metadata
from dualpace.serve.logging_setup import get_logger
from dualpace.wire import assist_messages
from dualpace.wire.v1 import assist_pb2, assist_pb2_grpc

# (layer, q, k, v) -> attention output [batch, num_heads * head_dim]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_ITERATION_TIMEOUT_S = 5.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Reconnect quickly after gpu_service restarts (gRPC's default backoff grows to 120 s).
_MAX_RECONNECT_BACKOFF_MS = 2000

DEFAULT_SHM_SLOT_BYTES = 1 << 20
log = get_logger(__name__)


class AssistClient:
    """Runs CPU engine iterations with the dense stages on gpu_service. One iteration at a time."""

    def __init__(
        self,
        address: str,
        iteration_timeout_s: float = DEFAULT_ITERATION_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        auth_token: str | None = None,
        transport: str = "auto",
        shm_slot_bytes: int = DEFAULT_SHM_SLOT_BYTES,
        shm_spin_s: float = assist_shm.shm_doorbell.DEFAULT_SPIN_S,
        credentials: grpc.ChannelCredentials | None = None,
        data_tls: ssl.SSLContext | None = None,
    ):
        if transport not in assist_shm.TRANSPORTS:
            raise InvalidArgument("--assist-transport", f"unknown transport {transport!r}; use "
                                  f"{' or '.join(assist_shm.TRANSPORTS)}")
        self.address = address
        self.transport = transport
        self._shm_slot_bytes = shm_slot_bytes
        self._shm_spin_s = shm_spin_s
        self._shm: assist_shm.ShmIterations | None = None  # the open stream's rings (or data socket)
        self._data_tls = data_tls  # TLS to the server's data socket (this daemon's, as `credentials`)
        self.num_shm_iterations = 0
        self.iteration_timeout_s = iteration_timeout_s
        self._metadata = token_metadata(auth_token)  # gpu_service's --auth-token-file token, if it requires one
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
        ]
        # credentials: TLS to a gpu_service that serves it (dualpace.serve.security.peer_credentials_for)
        self._channel = grpc.insecure_channel(address, options=options) if credentials is None else \
            grpc.secure_channel(address, credentials, options=options)
        self._assist = assist_pb2_grpc.DenseAssistStub(self._channel).Assist
        self._stream: AssistStream | None = None
        self._iteration_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self.consecutive_failures = 0  # AssistUnavailable raised since the last success
        self._downgrades = JoinDowngrades(address)
        self.last_join_info: assist_types.AssistJoinInfo | None = None  # how the last iteration ran
        self.last_iteration_id = 0  # the last begin's iteration_id

    @property
    def peer_accepts_join(self) -> bool:
        """The open stream's server can join iterations into its engine's steps (shm answer)."""
        return self._shm is not None and self._shm.accepts_join

    def run_iteration(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        attend: AttendFn,
        sampling: Sequence[tuple[SamplingParams, int]] | None = None,
        wait_for_engine_iteration: bool = False,
        max_device_wait_ms: int = 0,
        join: JoinAsk = NO_JOIN,
    ) -> list[int | None] | torch.Tensor:
        """One assisted decode iteration over a batch (one token per row).

        positions[i] is the absolute position of token_ids[i]; the sampled token
        is drawn for position + 1. With sampling (one (params, seed) per row)
        returns the next token id per row, None where the row's logits were not
        finite; with sampling None returns float32 logits [batch, vocab].
        wait_for_engine_iteration selects the gated baseline policy (the GPU starts
        the iteration only at its own engine's iteration boundary and keeps its device
        until the result); max_device_wait_ms bounds how long the GPU may keep the
        iteration waiting for its device, all layers' waits added up (past it the server
        answers RESOURCE_EXHAUSTED and this raises AssistUnavailable). join asks the server to
        run the rows inside its engine's next step (cpu_service/assist_join.py); how it ran is
        left in last_join_info. Raises AssistUnavailable (run the iteration locally instead).
        """
        with self._lock:
            if self._closed:
                raise AssistUnavailable(f"dense assist at {self.address}: the client is closed")
            begin = assist_types.AssistBegin(
                iteration_id=next(self._iteration_ids),
                token_ids=list(token_ids),
                positions=list(positions),
                sampling=None if sampling is None else list(sampling),
                wait_for_engine_iteration=wait_for_engine_iteration,
                max_device_wait_ms=max_device_wait_ms,
                join_engine_iteration=join.join,
                max_join_wait_us=join.max_join_wait_us or 0,
                expected_layer_us=join.expected_layer_us,
            )
            self.last_join_info, self.last_iteration_id = None, begin.iteration_id
            try:
                result = self._exchange(begin, attend)
            except AssistUnavailable:
                self._drop_stream()
                self.consecutive_failures += 1
                raise
            except BaseException:
                self._drop_stream()
                raise
            self.consecutive_failures = 0
            self.last_join_info = result.join_info
            return self._output(begin, result)

    def _exchange(self, begin: assist_types.AssistBegin, attend: AttendFn) -> assist_types.AssistResult:
        """Run the iteration through the stream's rings (or data socket), opened first where none is."""
        if self._stream is None:
            self._stream = AssistStream(self._assist, self.address, self._metadata)
            self._shm = self._offer(self._stream)
        stream, rings = self._stream, self._shm
        batch = len(begin.token_ids)
        begin_bytes = assist_messages.begin_to_bytes(begin)
        downgraded = self._downgrades.begin_for_peer(begin, rings.accepts_join)
        if downgraded is not begin:  # the join asks were dropped: the bytes change (once per iteration)
            begin = downgraded
            begin_bytes = assist_messages.begin_to_bytes(begin)
        if not rings.fits(batch, begin_bytes):
            raise AssistUnavailable(f"dense assist at {self.address}: a batch of {batch} rows does not fit a slot "
                                    f"(at most {rings.max_batch_rows} rows)")
        deadline_s = assist_shm.deadline_after(self.iteration_timeout_s)
        result = rings.run(begin, begin_bytes, attend, deadline_s, stream.ended.is_set, self)
        if result is None:  # on the stream: the result did not fit a slot, or an error
            result = self._decode(stream.receive(deadline_s - time.monotonic()))
            if not isinstance(result, assist_types.AssistResult) or result.iteration_id != begin.iteration_id:
                raise self._protocol_error("expected the iteration's result on the stream")
        self._check_result(result, begin)
        self.num_shm_iterations += 1
        return result

    def _offer(self, stream: AssistStream) -> assist_shm.ShmIterations:
        """Offer a segment (with transport tcp, or where this process cannot share memory: the data
        socket alone) on a fresh stream; the accepted rings, or the data socket the server named.
        Raises AssistUnavailable where it grants neither."""
        segment, offer = None, None
        if self.transport == "auto":
            try:
                made = assist_shm.new_offer(self._shm_slot_bytes)
            except OSError as exc:
                log.warning("dense assist: no shared memory here, asking for the data socket", error=str(exc))
                made = None
            if made is not None:
                segment, offer = made
        if offer is None:
            offer = assist_shm.tcp_only_offer(self._shm_slot_bytes)
        try:
            stream.send(assist_messages.assist_up_to_pb(offer))
            answer = self._decode(stream.receive(self.iteration_timeout_s))
            if not isinstance(answer, assist_types.AssistShmAnswer):
                raise self._protocol_error("expected the answer to the shared-memory offer")
            if not answer.accepted:
                if segment is not None:
                    segment.close()
                    segment = None
                if not answer.tcp_port:
                    raise AssistUnavailable(f"dense assist at {self.address}: refused: {answer.reason}")
                return self._attach(stream, self._connect_tcp(answer, offer), answer)
            if not segment.verify_server_token(answer.token):
                raise self._protocol_error("the server's token is not in the segment it accepted")
            segment.close_fd()  # both sides hold only their mappings now
            return self._attach(stream, segment, answer)
        except BaseException:
            if segment is not None:
                segment.close()
            raise

    def _attach(self, stream: AssistStream, segment, answer: assist_types.AssistShmAnswer) -> assist_shm.ShmIterations:
        """The rings (or the data socket) of this stream; a stream that ends wakes their wait."""
        try:
            rings = assist_shm.ShmIterations(segment, answer, self._shm_spin_s)
        except BaseException:
            segment.close()
            raise
        stream.on_end = rings.interrupt
        if stream.ended.is_set():
            rings.interrupt()
        log.info("dense assist through " + ("a TCP data socket" if rings.over_tcp else "shared memory"),
                 max_batch_rows=answer.max_batch_rows)
        return rings

    def _connect_tcp(self, answer: assist_types.AssistShmAnswer, offer: assist_types.AssistShmOffer) -> TcpLink:
        """The connection to the server's data socket with its ticket. Where it cannot be reached (or
        its TLS cannot be spoken) this iteration runs locally; the next one tries a fresh stream."""
        if answer.tcp_tls and self._data_tls is None:
            raise AssistUnavailable(f"dense assist at {self.address}: its data socket speaks TLS, this client has none")
        try:
            connection = kv_tcp_data.connect(data_socket_peer_host(self.address), answer.tcp_port, answer.tcp_ticket,
                                             self.iteration_timeout_s, self._data_tls if answer.tcp_tls else None)
        except OSError as exc:
            raise AssistUnavailable(f"dense assist at {self.address}: cannot reach its data socket: {exc}") from None
        return TcpLink(slot_bytes_of_offer(offer.size_bytes), connection=connection)

    @property
    def data_path(self) -> str | None:
        """Where the open stream's iterations go: "shm" or "tcp" (None: no stream open)."""
        return None if self._shm is None else "tcp" if self._shm.over_tcp else "shm"

    def protocol(self, problem: str) -> AssistUnavailable:
        return self._protocol_error(problem)

    def timeout(self) -> AssistUnavailable:
        return AssistUnavailable(f"dense assist at {self.address}: no reply within the iteration timeout")

    def _decode(self, message: assist_pb2.AssistDown):
        try:
            return assist_messages.assist_down_from_pb(message)
        except ValueError as exc:
            raise self._protocol_error(str(exc)) from None

    def _check_result(self, result: assist_types.AssistResult, begin: assist_types.AssistBegin) -> None:
        batch = len(begin.token_ids)
        if result.token_ids is not None:
            if begin.sampling is None or len(result.token_ids) != batch:
                raise self._protocol_error("unexpected sampled token ids in the result")
        elif result.logits.dim() != 2 or result.logits.shape[0] != batch:
            raise self._protocol_error(f"result logits of shape {list(result.logits.shape)} for a batch of {batch}")

    @staticmethod
    def _output(begin: assist_types.AssistBegin, result: assist_types.AssistResult) -> list[int | None] | torch.Tensor:
        """The caller's view: logits, or token ids. The server returns logits instead of ids
        when some row's logits are not finite; such rows are sampled here and come back None."""
        if result.token_ids is not None:
            return list(result.token_ids)
        logits = result.logits.float()
        if begin.sampling is None:
            return logits
        sampled = sample_next_tokens(
            logits,
            [params for params, _ in begin.sampling],
            [seed for _, seed in begin.sampling],
            [position + 1 for position in begin.positions],
        )
        return [token_id if finite else None for token_id, finite in zip(sampled.token_ids, sampled.finite)]

    def _protocol_error(self, problem: str) -> AssistUnavailable:
        return AssistUnavailable(f"dense assist at {self.address}: protocol error: {problem}")

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def close(self) -> None:
        """End the stream and the channel; later run_iteration calls raise AssistUnavailable."""
        with self._lock:
            self._closed = True
            self._drop_stream()
            self._channel.close()

    def __enter__(self) -> AssistClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
