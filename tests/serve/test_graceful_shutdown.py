"""SIGTERM under load: health NOT_SERVING, new requests UNAVAILABLE, the running request
finishes (or, past --grace-s, is aborted), and the daemon exits 0 either way.

gpu_service runs the tiny model with every step slowed to STEP_DELAY_MS (a test-only
fault), so a request is reliably still running when the signal arrives.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.convert import finish_reason_from_pb
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2_grpc
from tests.daemons import Daemon, start_daemon

STEP_DELAY_MS = 40
PROMPT = [5, 9, 2, 11]


@dataclass
class Stream:
    """A Generate call read on a thread."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: grpc.RpcError | None = None
    first_token: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def start_stream(address: str, request_id: str, max_tokens: int) -> Stream:
    stream = Stream()

    def read() -> None:
        try:
            with grpc.insecure_channel(address) as channel:
                request = new_request_to_pb(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for response in engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60):
                    stream.tokens.extend(response.token_ids)
                    stream.finish_reason = finish_reason_from_pb(response.finish_reason)
                    if stream.tokens:
                        stream.first_token.set()
        except grpc.RpcError as exc:
            stream.error = exc
        finally:
            stream.first_token.set()
            stream.done.set()

    threading.Thread(target=read, daemon=True).start()
    return stream


def start_slow_gpu(folder: str, *flags: str) -> Daemon:
    return start_daemon("gpu_service", "--model", folder, "--dtype", "fp32", "--threads", "1", "--kv-blocks", "64",
                        "--block-size", "8", *flags, env={"DUALPACE_FAULT_STEP_DELAY_MS": str(STEP_DELAY_MS)})


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.fixture(scope="module")
def folder(synth_checkpoint) -> str:
    return str(synth_checkpoint("tiny-llama"))


def test_sigterm_drains_running_requests(folder: str) -> None:
    daemon = start_slow_gpu(folder)  # default --grace-s 30
    try:
        stream = start_stream(daemon.address, "long", max_tokens=40)  # about 40 steps: 1.6 s or more
        assert stream.first_token.wait(30) and stream.error is None, daemon.log()
        daemon.process.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(daemon.address) as channel:
            deadline = time.monotonic() + 5
            while health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health never said NOT_SERVING"
                time.sleep(0.01)
            # Draining: a new request is refused, the running one goes on.
            request = new_request_to_pb("late", PROMPT, SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as refused:
                list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in refused.value.details()
            assert not stream.done.is_set(), "the request ended before the refusal was tested"
        assert stream.done.wait(30)
        assert stream.error is None, stream.error
        assert len(stream.tokens) == 40 and stream.finish_reason == FinishReason.LENGTH
        assert daemon.process.wait(20) == 0, daemon.log()
    finally:
        daemon.kill()
    assert "drained" in daemon.log()


def test_past_the_grace_requests_are_aborted_and_exit_is_clean(folder: str) -> None:
    daemon = start_slow_gpu(folder, "--grace-s", "0.5")
    try:
        stream = start_stream(daemon.address, "endless", max_tokens=400)  # 16 s or more
        assert stream.first_token.wait(30) and stream.error is None, daemon.log()
        signalled = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        assert stream.done.wait(15)
        assert stream.error is None, stream.error
        assert stream.finish_reason == FinishReason.ABORT and 0 < len(stream.tokens) < 400
        assert daemon.process.wait(20) == 0, daemon.log()
        assert time.monotonic() - signalled < 10
    finally:
        daemon.kill()
    assert "aborted 1 requests" in daemon.log()
