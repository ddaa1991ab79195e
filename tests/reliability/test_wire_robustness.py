"""What arrives on the wire is not always gRPC, nor well-formed.

One gpu_service for the module. Criteria for every case: a clean gRPC error (or, for bytes
that are not HTTP/2 at all, a closed connection), never a crash or a hang; afterwards the
daemon says SERVING, serves a valid request, and holds no KV block.

- garbage bytes on the port, over a raw socket;
- messages over the server's maximum receive size (64 MiB) on Generate and ImportKv:
  RESOURCE_EXHAUSTED;
- malformed KV headers on ImportKv, generated with hypothesis from a valid transfer with one
  defect each (dtype or shape), and KV said written through a data socket the header never
  offered: INVALID_ARGUMENT naming the field, and any blocks reserved by the header freed again.
"""

from __future__ import annotations

import itertools
import socket
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualpace.serve.server import DEFAULT_MAX_MESSAGE_BYTES
from dualpace.wire.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.reliability.conftest import (
    EngineProbe,
    assert_clean_exit,
    start_gpu,
)
from tests.helpers import wait_for
from tests.reliability.kv_transfers import DTYPE_SIZES, ImportCall, kv_header

PROMPT = [(5 * i + 2) % 500 + 1 for i in range(10)]
OUTPUTS = [7, 8, 9]
NUM_COMPUTED = len(PROMPT) + len(OUTPUTS) - 1
U32 = 2**32 - 1
_ids = itertools.count()
HYPOTHESIS = settings(max_examples=25, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def engine(tiny_folder):
    daemon = start_gpu(tiny_folder, "--name", "gpu-wire", "--kv-blocks", "64", "--block-size", "8")
    probe = EngineProbe(daemon.address)
    try:
        yield daemon, probe
    finally:
        probe.close()
        assert daemon.process.poll() is None, f"the daemon died:\n{daemon.log()[-3000:]}"
        assert_clean_exit([daemon])


def assert_still_serving(daemon, probe: EngineProbe) -> None:
    assert daemon.process.poll() is None, daemon.log()[-3000:]
    probe.assert_serving_and_generates(f"valid-{next(_ids)}")
    assert wait_for(probe.blocks_used, lambda used: used == 0, timeout_s=5) == 0


# ---------------------------------------------------------------------- garbage bytes

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GARBAGE = {
    "random bytes": bytes((i * 97 + 13) % 256 for i in range(4096)),
    "HTTP/1.1 request": b"GET /dualpace.v1.Engine/GetLoad HTTP/1.1\r\nHost: x\r\n\r\n",
    "TLS client hello": bytes.fromhex("160301002e0100002a0303") + bytes(32) + b"\x00\x00\x02\x00\x2f\x01\x00",
    "preface then garbage frames": HTTP2_PREFACE + bytes(range(256)) * 8,
    "preface then a frame claiming 16 MiB": HTTP2_PREFACE + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + b"x" * 100,
    "half a preface": HTTP2_PREFACE[:10],
    "nothing (connect and close)": b"",
}


@pytest.mark.parametrize("payload", list(GARBAGE))
def test_garbage_bytes_on_the_port(engine, payload):
    daemon, probe = engine
    host, port = daemon.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.settimeout(5)
        try:
            sock.sendall(GARBAGE[payload])
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and sock.recv(65536):
                pass  # the server answers (e.g. a GOAWAY) and closes
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            pass  # a reset or silence is an acceptable way to refuse garbage
    assert_still_serving(daemon, probe)


# ---------------------------------------------------------------------- oversized messages


def test_oversized_messages_are_refused(engine):
    daemon, probe = engine
    too_big = DEFAULT_MAX_MESSAGE_BYTES + 1024
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(daemon.address, options=options) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = engine_pb2.EngineGenerateRequest(new_request=engine_pb2.NewEngineRequest(
            request_id="huge", prompt_token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=2, stop=["x" * too_big])))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value

        info = probe.info()
        call = ImportCall(stub)
        try:
            huge = kv_header("huge-import", PROMPT, OUTPUTS, 64, info)
            huge.header.source_engine = "x" * too_big
            call.send(huge)
            call.close()
            assert call.done.wait(60)
        finally:
            call.cancel()
        assert call.error is not None and call.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.error
    assert "huge" not in probe.requests() and "huge-import" not in probe.requests()
    assert_still_serving(daemon, probe)


# ---------------------------------------------------------------------- malformed KV headers


def mutations(info: engine_pb2.EngineInfo):
    """(name, mutate(header) -> None, field the error must name) with one defect each."""

    def setter(path: str, value):
        def mutate(header):
            target_message = header.header
            *parents, leaf = path.split(".")
            for parent in parents:
                target_message = getattr(target_message, parent)
            setattr(target_message, leaf, value)
        return mutate

    return st.one_of(
        st.text(min_size=0, max_size=12).filter(lambda d: d not in DTYPE_SIZES).map(
            lambda d: (f"unknown dtype {d!r}", setter("layout.dtype", d), "header.layout.dtype")),
        st.integers(0, U32).filter(lambda n: n != info.num_kv_heads).map(
            lambda n: ("num_kv_heads", setter("layout.num_kv_heads", n), "header.layout")),
        st.integers(0, U32).filter(lambda n: n != info.head_dim).map(
            lambda n: ("head_dim", setter("layout.head_dim", n), "header.layout")),
        st.integers(0, U32).filter(lambda n: n != info.num_layers).map(
            lambda n: ("num_layers", setter("layout.num_layers", n), "header.layout")),
        st.integers(1, U32).filter(lambda n: n != NUM_COMPUTED).map(
            lambda n: ("num_computed_tokens", setter("num_computed_tokens", n), "header.num_computed_tokens")),
    )


def test_malformed_kv_headers_get_clean_errors(engine):
    daemon, probe = engine
    info = probe.info()

    @HYPOTHESIS
    @given(mutation=mutations(info))
    def check(mutation):
        name, mutate, field = mutation
        request_id = f"import-{next(_ids)}"
        header = kv_header(request_id, PROMPT, OUTPUTS, 64, info)
        mutate(header)
        call = ImportCall(probe.stub, timeout_s=30)
        try:
            call.send(header, engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()))
            call.close()
            assert call.done.wait(30), name
        finally:
            call.cancel()
        assert call.error is not None, f"{name}: accepted"
        assert call.error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, call.error.code(), call.error.details())
        assert field in call.error.details(), (name, call.error.details())
        assert not call.replies, name
        assert wait_for(probe.blocks_used, lambda used: used == 0, timeout_s=5) == 0, name
        assert request_id not in probe.requests(), name

    check()
    assert_still_serving(daemon, probe)


def test_kv_said_written_without_a_data_socket_is_refused(engine):
    """The header offered neither shared memory nor the data socket: no KV can have been written."""
    daemon, probe = engine
    info = probe.info()
    call = ImportCall(probe.stub, timeout_s=30)
    try:
        written = engine_pb2.KvTcpWritten(layer_crc32=[0] * info.num_layers, commit=True)
        shm_written = engine_pb2.KvShmWritten(layer_crc32=[0] * info.num_layers, commit=True)
        call.send(kv_header("unoffered", PROMPT, OUTPUTS, 64, info), engine_pb2.ImportKvMessage(tcp_written=written),
                  engine_pb2.ImportKvMessage(shm_written=shm_written))
        call.close()
        assert call.done.wait(30)
    finally:
        call.cancel()
    assert call.error is not None and call.error.code() == grpc.StatusCode.INVALID_ARGUMENT, call.error
    assert "tcp_written" in call.error.details()
    assert not call.replies
    assert wait_for(probe.blocks_used, lambda used: used == 0, timeout_s=5) == 0
    assert "unoffered" not in probe.requests()
    assert_still_serving(daemon, probe)


def test_a_valid_hand_made_transfer_still_imports(engine):
    """The control for the tests above: a well-formed transfer commits (one without KV: the target
    recomputes it; a hand-made source has no pool to send KV from)."""
    daemon, probe = engine
    info = probe.info()
    call = ImportCall(probe.stub)
    try:
        call.send(kv_header("control", PROMPT, OUTPUTS, 6, info, with_kv=False),
                  engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()),
                  engine_pb2.ImportKvMessage(commit=engine_pb2.ImportKvCommit()))
        call.close()
        assert call.done.wait(30)
    finally:
        call.cancel()
    assert call.error is None, call.error
    assert [r.WhichOneof("kind") for r in call.replies] == ["prepared", "committed"]
    resume = engine_pb2.EngineGenerateRequest(resume=engine_pb2.ResumeEngineRequest(request_id="control",
                                                                                    from_token_index=len(OUTPUTS)))
    responses = list(probe.stub.Generate(resume, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 6 - len(OUTPUTS)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_still_serving(daemon, probe)


def test_malformed_reservations_ahead_get_clean_errors(engine):
    """Blocks reserved ahead of a header (ImportKvMessage.shm_reserve_ahead): a wrong layout, no tokens,
    another host's boot id, a second reservation, or written KV before any header is refused with
    INVALID_ARGUMENT naming the field, and no block stays reserved."""
    daemon, probe = engine
    info = probe.info()

    def ahead(num_tokens: int = 32, boot: str | None = None, **layout) -> engine_pb2.ImportKvMessage:
        shape = dict(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                     block_size=info.block_size, dtype="float32") | layout
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            own_boot = file.read().strip()
        return engine_pb2.ImportKvMessage(shm_reserve_ahead=engine_pb2.KvShmReserveAhead(
            layout=engine_pb2.KvLayout(**shape), num_tokens=num_tokens,
            shm_offer=engine_pb2.KvShmOffer(boot_id=own_boot if boot is None else boot)))

    shm_written = engine_pb2.ImportKvMessage(shm_written=engine_pb2.KvShmWritten(
        layer_crc32=[0] * info.num_layers, commit=True))
    cases = [
        ("another shape", [ahead(num_kv_heads=info.num_kv_heads + 1)], "shm_reserve_ahead.layout", 0),
        ("no tokens", [ahead(num_tokens=0)], "shm_reserve_ahead.num_tokens", 0),
        ("another host", [ahead(boot="another-host")], "shm_reserve_ahead.shm_offer", 0),
        ("twice", [ahead(), ahead()], "shm_reserve_ahead", 1),
        ("written before a header", [ahead(), shm_written], "shm_written", 1),
    ]
    for name, messages, field, num_replies in cases:
        call = ImportCall(probe.stub, timeout_s=30)
        try:
            call.send(*messages)
            call.close()
            assert call.done.wait(30), name
        finally:
            call.cancel()
        assert call.error is not None and call.error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, call.error)
        assert field in call.error.details(), (name, call.error.details())
        assert len(call.replies) == num_replies, name  # the reservation's answer, where one was made
        assert wait_for(probe.blocks_used, lambda used: used == 0, timeout_s=5) == 0, name
    assert_still_serving(daemon, probe)
