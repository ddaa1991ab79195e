"""SIGTERM under load past --grace-s, for an engine and for the router: the running request is
aborted (the router ends its streams with UNAVAILABLE and aborts the engine request) and the
daemon exits 0. The drain within the grace is tests/reliability/test_drain.py's.

gpu_service runs the tiny model with every step slowed to STEP_DELAY_MS (a test-only
fault), so a request is reliably still running when the signal arrives. The tests assert the
order of events and their outcomes; every wait is a hang guard (HANG_GUARD_S), never a
criterion.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import grpc

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.common import finish_reason_from_pb
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from toolkit.processes import Daemon, start_daemon

STEP_DELAY_MS = 40
HANG_GUARD_S = 60.0
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


def test_past_the_grace_requests_are_aborted_and_exit_is_clean(tiny_folder: str) -> None:
    daemon = start_slow_gpu(tiny_folder, "--grace-s", "0.5")
    try:
        stream = start_stream(daemon.address, "endless", max_tokens=400)  # 16 s or more
        assert stream.first_token.wait(HANG_GUARD_S) and stream.error is None, daemon.log()
        daemon.process.send_signal(signal.SIGTERM)
        assert stream.done.wait(HANG_GUARD_S)
        assert stream.error is None, stream.error
        # Ended by the grace, not by running to its end.
        assert stream.finish_reason == FinishReason.ABORT and 0 < len(stream.tokens) < 400
        assert daemon.process.wait(HANG_GUARD_S) == 0, daemon.log()
    finally:
        daemon.kill()
    assert "aborted 1 requests" in daemon.log()


# ---------------------------------------------------------------------- the router


def router_stream(address: str, request_id: str, max_tokens: int) -> Stream:
    stream = Stream()

    def read() -> None:
        try:
            with grpc.insecure_channel(address) as channel:
                request = router_pb2.GenerateRequest(
                    request_id=request_id, prompt_token_ids=common_pb2.TokenIds(token_ids=PROMPT),
                    sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=HANG_GUARD_S):
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


def start_router(folder: str, gpu: Daemon, *flags: str) -> Daemon:
    return start_daemon("router", "serve", "--gpu", gpu.address, "--model", folder, "--policy", "gpu-only",
                        "--no-migrate", *flags)


def test_router_past_the_grace_cancels_streams_and_exits_cleanly(tiny_folder: str) -> None:
    gpu = start_slow_gpu(tiny_folder)
    router = None
    try:
        router = start_router(tiny_folder, gpu, "--grace-s", "0.5")
        stream = router_stream(router.address, "endless", max_tokens=400)  # 16 s or more
        assert stream.first_token.wait(HANG_GUARD_S) and stream.error is None, router.log()
        router.process.send_signal(signal.SIGTERM)
        assert stream.done.wait(HANG_GUARD_S)
        # The client learns why its stream ended; the router logs no error about it.
        assert stream.error is not None, "the stream finished inside a 0.5 s grace"
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        assert "grace of 0.5 s is over" in stream.error.details()
        assert 0 < len(stream.tokens) < 400
        assert router.process.wait(HANG_GUARD_S) == 0, router.log()
        assert "grace of 0.5 s is over: cancelling 1 relayed streams" in router.log()
        assert "Exception not handled" not in router.log(), router.log()
        # The router aborted the engine request it gave up on.
        with grpc.insecure_channel(gpu.address) as channel:
            engine = engine_pb2_grpc.EngineStub(channel)
            deadline = time.monotonic() + HANG_GUARD_S
            while engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).num_running:
                assert time.monotonic() < deadline, "the engine still runs the cancelled request"
                time.sleep(0.05)
    finally:
        if router is not None:
            router.kill()
        gpu.kill()
