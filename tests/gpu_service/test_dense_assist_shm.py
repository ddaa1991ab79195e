"""Dense Assist through shared memory: what only that path has (the shared tests of
test_dense_assist.py run on both transports).

- a result too large for a slot comes on the stream, a batch too large for the slots runs over
  gRPC on the same stream, and both stay equal to the in-process forward;
- a server that refuses shared memory, an offer from another host, a wrong token or path: the
  offer is refused with a reason and the iterations run over gRPC;
- a malformed slot ends the stream with INVALID_ARGUMENT and frees the device;
- the server's idle timeout holds on the ring: a client that stops mid-iteration is ended with
  DEADLINE_EXCEEDED and the device lock is released; so does its stage timeout, for a stage that
  computes too long.
"""

from __future__ import annotations

import os
import threading

import grpc
import pytest
import torch

from cpu_service import assist_shm
from cpu_service.assist_client import AssistClient, AssistUnavailable
from dualpace.engine.assist.assist_types import AssistBegin, AssistShmOffer, ShmSlotKind
from dualpace.engine.transfer.same_host import boot_id
from dualpace.engine.assist.shm_ring import ShmSegment, SlotMessage
from dualpace.wire.assist_messages import begin_to_bytes
from gpu_service.assist_limits import AssistLimits
from gpu_service.assist_shm_session import accept_offer
from gpu_service.dense_assist import DenseAssistExecutor
from tests.gpu_service.test_dense_assist import (
    HANG_GUARD_S,
    _CountingExecutor,
    _prefilled,
    _reference_step,
    _ServerThread,
    _zeros_attend,
    loaded,  # noqa: F401 - the module's model fixture
    server,  # noqa: F401
)

pytestmark = pytest.mark.skipif(not assist_shm.shm_doorbell.SUPPORTED, reason="shared memory needs Linux x86-64")


def _logit_steps(client: AssistClient, loaded, num_steps: int) -> None:  # noqa: F811
    host, reference, token_ids = _prefilled(loaded, num_steps)
    for _ in range(num_steps):
        host.lengths = [n + 1 for n in host.lengths]
        logits = client.run_iteration(token_ids, [n - 1 for n in host.lengths], host.attend)
        expected = _reference_step(reference, host, token_ids)
        assert (logits - expected).abs().max().item() < 1e-5
        token_ids = expected.argmax(dim=1).tolist()


def test_logits_too_large_for_a_slot_come_on_the_stream(loaded, server) -> None:  # noqa: F811
    with AssistClient(server.address, iteration_timeout_s=HANG_GUARD_S, shm_slot_bytes=4096) as client:
        _logit_steps(client, loaded, 3)
        assert client.num_shm_iterations == 3  # q/k/v fit the slots, the logits [3, vocab] do not
    assert server.executor.num_sessions == 1


def test_a_batch_too_large_for_the_slots_runs_locally(loaded, server) -> None:  # noqa: F811
    slot_bytes = 1280  # two rows of the tiny model's q/k/v in float32, not three
    with AssistClient(server.address, iteration_timeout_s=HANG_GUARD_S, shm_slot_bytes=slot_bytes) as client:
        with pytest.raises(AssistUnavailable, match="does not fit a slot"):
            client.run_iteration([1, 2, 3], [0, 0, 0], _zeros_attend(loaded))  # the caller runs it locally
        assert client.num_shm_iterations == 0
        logits = client.run_iteration([1, 2], [0, 0], _zeros_attend(loaded))  # batch 2: through the rings
        assert logits.shape == (2, loaded.config.vocab_size) and client.num_shm_iterations == 1


def test_a_server_without_shared_memory_answers_with_its_data_socket(loaded) -> None:  # noqa: F811
    running = _ServerThread(_CountingExecutor(loaded.model))
    running.limits = AssistLimits(shm_enabled=False)
    running.start()
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            _logit_steps(client, loaded, 2)
            assert client.num_shm_iterations == 2 and client.data_path == "tcp"
    finally:
        running.stop()


def test_offers_from_elsewhere_are_refused_with_a_reason(loaded) -> None:  # noqa: F811
    segment = ShmSegment.create(2, 4096)
    limits = AssistLimits()
    try:
        good = AssistShmOffer(boot_id(), segment.peer_path, segment.size_bytes, segment.client_token)
        cases = {
            "another host": AssistShmOffer("0" * 36, good.path, good.size_bytes, good.token),
            "another token": AssistShmOffer(good.boot_id, good.path, good.size_bytes, os.urandom(16)),
            "no such path": AssistShmOffer(good.boot_id, "/proc/self/fd/99999", good.size_bytes, good.token),
            "wrong size": AssistShmOffer(good.boot_id, good.path, good.size_bytes + 4096, good.token),
        }
        for case, offer in cases.items():
            answer, mapped = accept_offer(offer, loaded.model, limits, 0)
            assert not answer.accepted and mapped is None and answer.reason, case
        answer, mapped = accept_offer(good, loaded.model, AssistLimits(max_shm_streams=1), 1)
        assert not answer.accepted and "streams already" in answer.reason
        answer, mapped = accept_offer(good, loaded.model, limits, 0)
        assert answer.accepted and answer.max_batch_rows >= 1 and segment.verify_server_token(answer.token)
        mapped.close()
    finally:
        segment.close()


class _RawRing:
    """A client that speaks the ring by hand: an accepted segment over a raw AssistClient stream."""

    def __init__(self, address: str):
        self.client = AssistClient(address, iteration_timeout_s=HANG_GUARD_S)
        self.client.run_iteration([1], [0], lambda layer, q, k, v: torch.zeros(1, q.shape[1] * q.shape[2]))
        self.rings = self.client._shm  # the stream and its accepted rings, still open
        self.stream = self.client._stream
        assert self.rings is not None

    def end_status(self) -> grpc.StatusCode | None:
        assert self.stream.ended.wait(HANG_GUARD_S)
        with pytest.raises(AssistUnavailable) as raised:
            self.stream.receive(0)
        return raised.value.code


def test_a_malformed_slot_ends_the_stream_invalid_argument(loaded, server) -> None:  # noqa: F811
    raw = _RawRing(server.address)
    raw.rings._endpoint.send(SlotMessage(ShmSlotKind.QKV, 2, 0))  # a downstream kind, sent up
    assert raw.end_status() == grpc.StatusCode.INVALID_ARGUMENT
    raw.client.close()
    with server.executor.device_lock:  # released
        pass
    with AssistClient(server.address, iteration_timeout_s=HANG_GUARD_S) as client:
        assert client.run_iteration([1], [0], _zeros_attend(loaded)).shape == (1, loaded.config.vocab_size)
        assert client.num_shm_iterations == 1


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_a_client_silent_on_the_ring_is_ended_deadline_exceeded(loaded, gated) -> None:  # noqa: F811
    running = _ServerThread(DenseAssistExecutor(loaded.model))
    running.limits = AssistLimits(idle_timeout_s=0.5)
    running.start()
    try:
        raw = _RawRing(running.address)
        begin = begin_to_bytes(AssistBegin(99, [1], [0], None, wait_for_engine_iteration=gated))
        raw.rings._endpoint.send(SlotMessage(ShmSlotKind.BEGIN, 99, 0, [], begin))  # then silence
        assert raw.end_status() == grpc.StatusCode.DEADLINE_EXCEEDED
        raw.client.close()
        assert running.executor.device_lock.acquire(timeout=HANG_GUARD_S)  # the gated iteration let go
        running.executor.device_lock.release()
    finally:
        running.stop()


class _SlowStageExecutor(DenseAssistExecutor):
    """Sessions whose layer-1 stage computes for longer than any stage timeout (a hung kernel, say)."""

    release = None

    def new_session(self):
        session = super().new_session()
        slow = session.attention_output

        def attention_output(message):
            if message.layer == 1:
                self.release.wait(HANG_GUARD_S)
            return slow(message)

        session.attention_output = attention_output
        return session


def test_a_stage_past_the_stage_timeout_on_the_ring_is_deadline_exceeded(loaded) -> None:  # noqa: F811
    """The ring thread cannot be interrupted mid-stage; the event loop's watchdog ends the stream
    (DEADLINE_EXCEEDED naming the stage timeout), and the session closes once the stage returns."""
    executor = _SlowStageExecutor(loaded.model)
    executor.release = threading.Event()
    running = _ServerThread(executor)
    running.limits = AssistLimits(stage_timeout_s=0.5)
    running.start()
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            with pytest.raises(AssistUnavailable) as raised:
                client.run_iteration([1], [0], _zeros_attend(loaded))
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "stage timeout" in str(raised.value)
            executor.release.set()
            assert client.run_iteration([1], [0], _zeros_attend(loaded)).shape == (1, loaded.config.vocab_size)
            assert client.num_shm_iterations == 1
    finally:
        executor.release.set()
        running.stop()
