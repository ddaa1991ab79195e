"""Dense Assist over the TCP data socket: what only that path has (the shared tests of
test_dense_assist.py run on it as transport "tcp").

- a connection with a wrong ticket is refused by the data socket: the iteration fails over to the
  caller (AssistUnavailable, it runs locally), and the next stream's ticket works;
- the data socket failing mid-iteration while the gRPC stream is up: AssistUnavailable (the
  iteration runs locally), and the next iteration runs on a fresh stream and connection;
- where the data socket speaks TLS, a client with the daemons' TLS runs its iterations through it
  (the same logits as over gRPC), one without runs that iteration locally and the next ones over gRPC;
- the frame format round-trips every dtype and shape the session sends, and a malformed frame
  (a size past the buffer) is refused with TcpLinkError.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import time

import pytest
import torch

from cpu_service.assist_client import AssistClient, AssistUnavailable
from dualpace.engine.assist.assist_tcp_link import TcpLink, TcpLinkError
from dualpace.engine.assist.assist_types import ShmSlotKind
from tests.serve.test_security import _self_signed
from dualpace.serve.security import load_tls
from tests.gpu_service.test_dense_assist import (
    HANG_GUARD_S,
    _CountingExecutor,
    _ServerThread,
    _zeros_attend,
    loaded,  # noqa: F401 - the module's model fixture
    server,  # noqa: F401
)


class _WrongTicketOnce(AssistClient):
    """Presents a wrong ticket on its first data-socket connection."""

    wrong_left = 1

    def _connect_tcp(self, answer, offer):
        if self.wrong_left:
            self.wrong_left -= 1
            answer = dataclasses.replace(answer, tcp_ticket=bytes(len(answer.tcp_ticket)))
        return super()._connect_tcp(answer, offer)


def test_a_wrong_ticket_is_refused_and_the_next_stream_connects(loaded, server) -> None:  # noqa: F811
    with _WrongTicketOnce(server.address, iteration_timeout_s=HANG_GUARD_S, transport="tcp") as client:
        with pytest.raises(AssistUnavailable):
            client.run_iteration([1, 2], [0, 0], _zeros_attend(loaded))
        assert server.data_socket.num_refused == 1
        logits = client.run_iteration([1, 2], [0, 0], _zeros_attend(loaded))  # a fresh stream, its own ticket
        assert logits.shape == (2, loaded.config.vocab_size)
        assert client.data_path == "tcp" and client.num_shm_iterations == 1


def test_a_data_socket_failing_mid_iteration_fails_only_that_iteration(loaded, server) -> None:  # noqa: F811
    client = AssistClient(server.address, iteration_timeout_s=HANG_GUARD_S, transport="tcp")
    zeros = _zeros_attend(loaded)

    def attend(layer, q, k, v):
        if layer == 1:  # the connection breaks under the session (a NIC or a middlebox), the stream does not
            client._shm._segment.connection().shutdown(socket.SHUT_RDWR)
        return zeros(layer, q, k, v)

    with client:
        with pytest.raises(AssistUnavailable, match="data socket"):
            client.run_iteration([1, 2], [0, 0], attend)
        logits = client.run_iteration([1, 2], [0, 0], zeros)
        assert logits.shape == (2, loaded.config.vocab_size) and client.data_path == "tcp"
    assert server.executor.num_sessions == 2


def test_a_tls_data_socket_serves_a_client_with_tls_only(loaded, tmp_path) -> None:  # noqa: F811
    cert, key = _self_signed(tmp_path, "engine")  # the certificate, and the CA both sides trust
    tls = load_tls(str(cert), str(key), str(cert))
    running = _ServerThread(_CountingExecutor(loaded.model))
    running.data_tls = tls.data_server_context()
    running.start()
    try:
        attend = _zeros_attend(loaded)
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S, transport="tcp",
                          data_tls=tls.data_client_context()) as client:
            assert client.run_iteration([1, 2], [0, 0], attend).shape == (2, loaded.config.vocab_size)
            assert client.data_path == "tcp" and client.num_shm_iterations == 1
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S, transport="tcp") as client:
            for _ in range(2):  # each iteration runs locally; the next one asks again
                with pytest.raises(AssistUnavailable, match="TLS"):
                    client.run_iteration([1, 2], [0, 0], attend)
            assert client.data_path is None and client.num_shm_iterations == 0
    finally:
        running.stop()


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    yield TcpLink(1 << 16, connection=left).endpoint("up"), TcpLink(1 << 16, connection=right).endpoint("down")
    left.close()
    right.close()


def test_frames_round_trip(pair) -> None:
    up, down = pair
    tensors = (torch.randn(3, 4, 8), torch.randn(3, 2, 8).bfloat16(), torch.arange(5))
    for layer in range(3):  # the cached layouts are reused from the second frame on
        up.send_parts(ShmSlotKind.QKV, 7, layer, tensors, b"stamp")
        message = down.receive(None)
        assert (message.kind, message.iteration_id, message.layer, message.payload) == (ShmSlotKind.QKV, 7, layer,
                                                                                      b"stamp")
        assert all(torch.equal(got, sent) for got, sent in zip(message.tensors, tensors))
    down.send_parts(ShmSlotKind.RESULT_ON_STREAM, 7, 0, ())
    assert up.receive(None).kind == ShmSlotKind.RESULT_ON_STREAM


def test_a_frame_larger_than_the_buffer_is_refused(pair) -> None:
    up, down = pair
    up._link.connection().sendall(struct.pack("=Q", 1 << 30) + bytes(248))
    with pytest.raises(TcpLinkError, match="frame"):
        down.receive(time.monotonic() + HANG_GUARD_S / 10)  # (a hang guard: the refusal comes at once)
