"""What arrives on the wire is not always gRPC, nor well-formed.

One gpu_service for the module. Criteria for every case: a clean gRPC error (or, for bytes
that are not HTTP/2 at all, a closed connection), never a crash or a hang; afterwards the
daemon says SERVING, serves a valid request, and holds no KV block.

- garbage bytes on the port, over a raw socket;
- messages over the server's maximum receive size (64 MiB) on Generate and ImportKv:
  RESOURCE_EXHAUSTED;
- malformed KV chunks on ImportKv, generated with hypothesis from a valid transfer with one
  defect each (bad sizes, sequence numbers, layers, token ranges, dtype or shape, crc32):
  INVALID_ARGUMENT naming the field, and the blocks reserved by the header freed again.
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
from tests.reliability.kv_transfers import DTYPE_SIZES, ImportCall, kv_chunk, kv_header

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
            huge = kv_chunk(0, 0, 0, NUM_COMPUTED, info)
            huge.chunk.k = b"\0" * too_big
            call.send(kv_header("huge-import", PROMPT, OUTPUTS, 64, info), huge)
            call.close()
            assert call.done.wait(60)
        finally:
            call.cancel()
        assert call.error is not None and call.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.error
    assert "huge" not in probe.requests() and "huge-import" not in probe.requests()
    assert_still_serving(daemon, probe)


# ---------------------------------------------------------------------- malformed KV chunks


def mutations(info: engine_pb2.EngineInfo):
    """(name, mutate(header, chunk) -> None, field the error must name) with one defect each."""
    per_token = info.num_kv_heads * info.head_dim * 4
    right = NUM_COMPUTED * per_token

    def sizes(wrong_size):
        return st.integers(0, 3 * right).filter(lambda n: n != right).map(wrong_size)

    def resized(which: str, size: int):
        def mutate(header, chunk):
            data = bytes(i % 251 for i in range(size))
            setattr(chunk.chunk, which, data)
            chunk.chunk.crc32 = crc(chunk.chunk.k, chunk.chunk.v)
        return mutate

    def setter(path: str, value):
        def mutate(header, chunk):
            target_message, attribute = (header.header, path[7:]) if path.startswith("header.") else \
                (chunk.chunk, path)
            *parents, leaf = attribute.split(".")
            for parent in parents:
                target_message = getattr(target_message, parent)
            setattr(target_message, leaf, value)
        return mutate

    def as_dtype(dtype: str):
        def mutate(header, chunk):  # the header says one dtype, the chunk holds another's bytes
            header.header.layout.dtype = dtype
            chunk_bytes_per_tensor = NUM_COMPUTED * info.num_kv_heads * info.head_dim * DTYPE_SIZES[dtype]
            header.header.total_bytes = 2 * chunk_bytes_per_tensor * info.num_layers
        return mutate

    def bad_crc(delta: int):
        def mutate(header, chunk):
            chunk.chunk.crc32 = (chunk.chunk.crc32 + delta) % 2**32
        return mutate

    def flipped(index: int):
        def mutate(header, chunk):  # a bit flipped in transit: the crc32 no longer matches
            k = bytearray(chunk.chunk.k)
            k[index % len(k)] ^= 0x10
            chunk.chunk.k = bytes(k)
        return mutate

    return st.one_of(
        sizes(lambda n: ("k size", resized("k", n), "chunk")),
        sizes(lambda n: ("v size", resized("v", n), "chunk")),
        st.integers(1, U32).map(lambda n: ("seq", setter("seq", n), "chunk.seq")),
        st.integers(info.num_layers, U32).map(lambda n: ("layer", setter("layer", n), "chunk.layer")),
        st.integers(1, U32).map(lambda n: ("token_start", setter("token_start", n), "chunk.token_start")),
        st.one_of(st.just(0), st.integers(NUM_COMPUTED + 1, U32)).map(
            lambda n: ("token_end", setter("token_end", n), "chunk.token_start")),
        st.sampled_from(["bfloat16", "float16"]).map(lambda d: (f"dtype {d}", as_dtype(d), "chunk")),
        st.text(min_size=0, max_size=12).filter(lambda d: d not in DTYPE_SIZES).map(
            lambda d: (f"unknown dtype {d!r}", setter("header.layout.dtype", d), "header.layout.dtype")),
        st.integers(0, U32).filter(lambda n: n != info.num_kv_heads).map(
            lambda n: ("num_kv_heads", setter("header.layout.num_kv_heads", n), "header.layout")),
        st.integers(0, U32).filter(lambda n: n != info.head_dim).map(
            lambda n: ("head_dim", setter("header.layout.head_dim", n), "header.layout")),
        st.integers(0, U32).filter(lambda n: n != info.num_layers).map(
            lambda n: ("num_layers", setter("header.layout.num_layers", n), "header.layout")),
        st.integers(1, U32 - 1).map(lambda n: ("crc32", bad_crc(n), "chunk.crc32")),
        st.integers(0, right - 1).map(lambda i: ("flipped bit", flipped(i), "chunk.crc32")),
    )


def crc(k: bytes, v: bytes) -> int:
    from dualpace.engine.transfer.kv_checksum import kv_checksum

    return kv_checksum(k, v)


def test_malformed_kv_chunks_get_clean_errors(engine):
    daemon, probe = engine
    info = probe.info()

    @HYPOTHESIS
    @given(mutation=mutations(info))
    def check(mutation):
        name, mutate, field = mutation
        request_id = f"import-{next(_ids)}"
        header = kv_header(request_id, PROMPT, OUTPUTS, 64, info)
        chunk = kv_chunk(0, 0, 0, NUM_COMPUTED, info)
        mutate(header, chunk)
        call = ImportCall(probe.stub, timeout_s=30)
        try:
            call.send(header, chunk, engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()))
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


def test_a_valid_hand_made_transfer_still_imports(engine):
    """The control for the test above: the same transfer without a defect commits."""
    daemon, probe = engine
    info = probe.info()
    call = ImportCall(probe.stub)
    try:
        call.send(kv_header("control", PROMPT, OUTPUTS, 6, info),
                  *(kv_chunk(layer, layer, 0, NUM_COMPUTED, info) for layer in range(info.num_layers)),
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
