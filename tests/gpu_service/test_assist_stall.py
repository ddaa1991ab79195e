"""A stalled Dense Assist client does not stall gpu_service.

A real gpu_service with a short `--assist-idle-timeout-s`. A client opens a session, gets its
first layer's q/k/v through the rings, and sends nothing more without closing its stream. For a gated session (the
NEO-like baseline, which holds the device lock from its begin to its result) the engine's own
steps cannot run until the server ends the session: the outcome checked is that the session
ends on the idle timeout, the engine's own Generate completes exactly, and a new assist
session runs a whole iteration (the lock was released). An ungated session holds the device only
during its stages: the engine serves on and the session ends the same way. The server's stage
timeout, in process: a stage that cannot get the device within it ends DEADLINE_EXCEEDED.
Every wait is a hang guard.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from cpu_service.assist_client import AssistClient, AssistUnavailable
from dualpace.sampling import SamplingParams
from dualpace.wire.v1 import engine_pb2_grpc
from gpu_service.dense_assist import DenseAssistExecutor
from toolkit.processes import start_daemon
from tests.gpu_service.conftest import COMMON_FLAGS, generate, wait_idle
from tests.gpu_service.test_dense_assist import _ServerThread, _zeros_attend
from tests.helpers import wait_for

HANG_GUARD_S = 120.0
IDLE_TIMEOUT_S = "2"
ENDED = "dense assist session ended"


class StalledSession:
    """An assist client whose first layer's attention never ends (until released): its session has
    its begin's reply, then the server hears nothing more through the rings."""

    def __init__(self, address: str, gated: bool, attend):
        self.client = AssistClient(address, iteration_timeout_s=HANG_GUARD_S)
        self.in_attend = threading.Event()
        self.release = threading.Event()
        self.error: AssistUnavailable | None = None
        self.done = threading.Event()

        def stalled_attend(layer, q, k, v):
            self.in_attend.set()
            self.release.wait(HANG_GUARD_S)
            return attend(layer, q, k, v)

        def run() -> None:
            try:
                self.client.run_iteration([1, 2], [0, 0], stalled_attend, wait_for_engine_iteration=gated)
            except AssistUnavailable as exc:
                self.error = exc
            finally:
                self.done.set()
        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.done.wait(HANG_GUARD_S)
        self.client.close()


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
    num_ended = daemon.log().count(ENDED)  # the module's daemon: an earlier test's sessions ended too
    stalled = StalledSession(daemon.address, gated, _zeros_attend(tiny_model))
    try:
        assert stalled.in_attend.wait(HANG_GUARD_S)  # the session is mid-iteration now
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        result = generate(stub, f"own-{gated}", [3, 1, 4, 1, 5], params)  # the engine's own request
        assert result.tokens == solo([3, 1, 4, 1, 5], params)
        ended = wait_for(daemon.log, lambda log: log.count(ENDED) > num_ended, HANG_GUARD_S)
        assert ended.count(ENDED) > num_ended
        assert "--assist-idle-timeout-s" in [line for line in ended.splitlines() if ENDED in line][-1]
        stalled.release.set()  # the client's attention ends: its iteration fails, the caller redoes it locally
        assert stalled.done.wait(HANG_GUARD_S) and stalled.error is not None
    finally:
        stalled.close()
    assert wait_idle(stub, HANG_GUARD_S) == 0
    with AssistClient(daemon.address, iteration_timeout_s=HANG_GUARD_S) as client:  # the device is free again
        logits = client.run_iteration([1], [0], _zeros_attend(tiny_model), wait_for_engine_iteration=gated)
        assert logits.shape == (1, tiny_model.config.vocab_size)
    assert ENDED in daemon.log()


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
