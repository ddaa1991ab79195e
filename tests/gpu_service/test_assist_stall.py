"""A stalled Dense Assist client does not stall gpu_service.

A real gpu_service with a short `--assist-idle-timeout-s`. A client opens a session, gets its
first stage's reply, and stops sending without closing its stream. For a gated session (the
NEO-like baseline, which holds the device lock from its begin to its result) the engine's own
steps cannot run until the server ends the session: the outcome checked is that the session
ends with DEADLINE_EXCEEDED, the engine's own Generate completes exactly, and a new assist
session runs a whole iteration (the lock was released). An ungated session holds the device only
during its stages: the engine serves on and the session ends the same way. The server's stage
timeout, in process: a stage that cannot get the device within it ends DEADLINE_EXCEEDED.
Every wait is a hang guard.
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
import torch

from cpu_service.assist_client import AssistClient, AssistUnavailable
from dualpace.sampling import SamplingParams
from dualpace.engine.assist_types import AssistBegin
from dualpace.wire import assist_messages
from dualpace.wire.v1 import assist_pb2_grpc, engine_pb2_grpc
from gpu_service.dense_assist import DenseAssistExecutor
from toolkit.processes import start_daemon
from tests.gpu_service.conftest import COMMON_FLAGS, generate, wait_idle
from tests.gpu_service.test_dense_assist import _ServerThread, _zeros_attend

HANG_GUARD_S = 120.0
IDLE_TIMEOUT_S = "2"


class StalledSession:
    """An Assist stream that sends one begin, reads the first reply, then sends nothing more."""

    def __init__(self, address: str, gated: bool):
        self.channel = grpc.insecure_channel(address)
        self._upstream: queue.Queue = queue.Queue()
        self.call = assist_pb2_grpc.DenseAssistStub(self.channel).Assist(iter(self._upstream.get, None),
                                                                        timeout=HANG_GUARD_S)
        self.replies: list = []
        self.error: grpc.RpcError | None = None
        self.first_reply = threading.Event()
        self.done = threading.Event()
        self._upstream.put(assist_messages.assist_up_to_pb(AssistBegin(
            1, [1, 2], [0, 0], None, wait_for_engine_iteration=gated)))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.append(reply)
                self.first_reply.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first_reply.set()
            self.done.set()

    def close(self) -> None:
        self._upstream.put(None)
        self.call.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def gpu(tiny_folder):
    daemon = start_daemon("gpu_service", "--model", tiny_folder, *COMMON_FLAGS, "--name", "gpu-stall",
                          "--kv-blocks", "64", "--block-size", "8", "--assist-idle-timeout-s", IDLE_TIMEOUT_S)
    channel = grpc.insecure_channel(daemon.address)
    yield daemon, engine_pb2_grpc.EngineStub(channel)
    channel.close()
    assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_stalled_session_ends_deadline_exceeded_and_the_engine_serves_on(gpu, solo, tiny_model, gated):
    daemon, stub = gpu
    stalled = StalledSession(daemon.address, gated)
    try:
        assert stalled.first_reply.wait(HANG_GUARD_S) and stalled.error is None, stalled.error
        assert stalled.replies[0].WhichOneof("kind") == "qkv"  # the session is mid-iteration now
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        result = generate(stub, f"own-{gated}", [3, 1, 4, 1, 5], params)  # the engine's own request
        assert result.tokens == solo([3, 1, 4, 1, 5], params)
        assert stalled.done.wait(HANG_GUARD_S)
        assert stalled.error is not None and stalled.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--assist-idle-timeout-s" in stalled.error.details()
    finally:
        stalled.close()
    assert wait_idle(stub, HANG_GUARD_S) == 0
    with AssistClient(daemon.address, iteration_timeout_s=HANG_GUARD_S) as client:  # the device is free again
        logits = client.run_iteration([1], [0], _zeros_attend(tiny_model), wait_for_engine_iteration=gated)
        assert logits.shape == (1, tiny_model.config.vocab_size)
    assert "dense assist session ended" in daemon.log()


def test_stage_past_the_server_stage_timeout_is_deadline_exceeded(tiny_model):
    """No client budget (max_device_wait_ms 0) and the device held by the engine: the stage gives
    up at the server's stage timeout with DEADLINE_EXCEEDED; once the device is free, the next
    iteration runs."""
    server = _ServerThread(DenseAssistExecutor(tiny_model.model, stage_timeout_s=0.2)).start()
    client = AssistClient(server.address, iteration_timeout_s=HANG_GUARD_S)
    try:
        with server.executor.device_lock:
            with pytest.raises(AssistUnavailable) as raised:
                client.run_iteration([1], [0], _zeros_attend(tiny_model))
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stage timeout" in str(raised.value)
        logits = client.run_iteration([1], [0], _zeros_attend(tiny_model))
        assert logits.shape == (1, tiny_model.config.vocab_size) and torch.isfinite(logits).all()
    finally:
        client.close()
        server.stop()
