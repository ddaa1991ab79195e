"""Fine-grained device sharing between the GPU engine's steps and Dense Assist stages.

An assisted iteration takes the device only for each stage's dense work; the engine's
forward offers the device between its layers (DeviceHandoff). These tests drive an
AssistSession and a PagedForward (the GPU engine's forward) on the same lock, in threads,
without gRPC. They assert the order of events (who held the device when) and outcomes, never
how long anything took; every wait is a hang guard.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dualpace.engine.assist.assist_types import AssistAttentionOutput, AssistBegin, AssistQkv, AssistResult
from dualpace.engine.gate import DeviceHandoff, IterationGate
from dualpace.errors import Overloaded
from dualpace.kv.storage import KVStorage
from dualpace.model.loader import LoadedModel, load_model
from dualpace.model.paged_forward import PagedForward, SequenceWork
from gpu_service.dense_assist import DenseAssistExecutor

BLOCK_SIZE = 4
WAIT_S = 60.0  # hang guard only: the machine running the tests may be busy


@pytest.fixture(scope="module")
def loaded(synth_checkpoint) -> LoadedModel:
    return load_model(str(synth_checkpoint("tiny-llama")), dtype="fp32")


class _Engine:
    """The GPU engine's side: a PagedForward over its own KV, each step under the device lock
    (as EngineLoop._step holds it), offering the device between layers."""

    def __init__(self, loaded: LoadedModel, handoff: DeviceHandoff, layer_pause_s: float = 0.0,
                 wait_for_stage: bool = False):
        cfg = loaded.config
        self.handoff = handoff
        self.kv = KVStorage(cfg.num_layers, 16, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                            loaded.model.dtype, loaded.model.device)
        self.forward = PagedForward(loaded.model, self.kv)
        self.forward.between_layers = self._between_layers
        self.layer_pause_s = layer_pause_s
        self.wait_for_stage = wait_for_stage  # hold the first layer boundary until a stage waits
        self.log: list[str] = []
        self.at_first_yield = threading.Event()
        self.num_steps = 0

    def _between_layers(self) -> None:
        self.log.append("engine-layer")
        self.at_first_yield.set()
        if self.wait_for_stage and self.log.count("engine-layer") == 1:
            assert _wait_until(lambda: self.handoff.num_waiting > 0), "no stage asked for the device"
        if self.layer_pause_s:
            time.sleep(self.layer_pause_s)  # a slow layer, still holding the device
        self.handoff.yield_to_waiting()

    def step(self) -> torch.Tensor:
        with self.handoff.lock:
            logits = self.forward.forward([SequenceWork([5, 6, 7, 8, 9], 0, [0, 1])])
        self.num_steps += 1
        self.log.append("engine-step-done")
        return logits


class _LoggingHandoff(DeviceHandoff):
    """Writes "assist-stage" into a log while a stage holds the device (before it releases it)."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.stage_log = log

    def acquire_stage(self, timeout_s: float) -> bool:
        acquired = super().acquire_stage(timeout_s)
        if acquired:
            self.stage_log.append("assist-stage")
        return acquired


def _wait_until(condition, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _in_thread(target) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = target()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _run_iteration(session, begin: AssistBegin, loaded: LoadedModel, between=None) -> AssistResult:
    """Drive one iteration; attention output = a fixed function of q (the CPU side's stand-in)."""
    reply = session.begin(begin)
    while isinstance(reply, AssistQkv):
        if between is not None:
            between(reply.layer)
        attention = torch.tanh(reply.q.reshape(reply.q.shape[0], -1))
        reply = session.attention_output(AssistAttentionOutput(begin.iteration_id, reply.layer, attention))
    return reply


def test_gpu_steps_run_while_an_assisted_iteration_is_between_layers(loaded) -> None:
    handoff = DeviceHandoff()
    engine = _Engine(loaded, handoff)
    reference = _run_iteration(DenseAssistExecutor(loaded.model).new_session(),
                               AssistBegin(1, [3, 4], [0, 2], None), loaded)
    session = DenseAssistExecutor(loaded.model, handoff).new_session()

    def between(layer: int) -> None:
        # the CPU side is computing attention: the device is free, the engine's steps complete
        assert not handoff.lock.locked()
        thread, box = _in_thread(engine.step)
        thread.join(WAIT_S)
        assert "result" in box, box

    result = _run_iteration(session, AssistBegin(1, [3, 4], [0, 2], None), loaded, between)
    assert engine.num_steps == loaded.config.num_layers
    assert torch.equal(result.logits, reference.logits)  # interleaving changes nothing (fp32, same ops)


def test_a_waiting_stage_gets_the_device_at_the_engines_next_layer(loaded) -> None:
    log: list[str] = []
    handoff = _LoggingHandoff(log)
    engine = _Engine(loaded, handoff, wait_for_stage=True)
    engine.log = log
    session = DenseAssistExecutor(loaded.model, handoff).new_session()
    thread, box = _in_thread(engine.step)
    assert engine.at_first_yield.wait(WAIT_S)
    session.begin(AssistBegin(1, [3], [0], None))  # a stage, asked for mid-step
    thread.join(WAIT_S)
    assert "result" in box, box
    assert handoff.num_handoffs == 1
    # The stage ran at the engine's first layer boundary, not after its whole step.
    assert log == ["engine-layer", "assist-stage"] + ["engine-layer"] * (loaded.config.num_layers - 2) + \
        ["engine-step-done"]
    session.close()


def test_neither_side_starves(loaded) -> None:
    """Engine steps back to back and assisted iterations back to back: both make progress,
    and stages are handed the device inside engine steps."""
    handoff = DeviceHandoff()
    engine = _Engine(loaded, handoff, layer_pause_s=0.005)
    stop = threading.Event()

    def engine_loop() -> int:
        while not stop.is_set():
            engine.step()
        return engine.num_steps

    thread, box = _in_thread(engine_loop)
    session = DenseAssistExecutor(loaded.model, handoff).new_session()
    num_iterations = 6
    for iteration_id in range(1, num_iterations + 1):
        result = _run_iteration(session, AssistBegin(iteration_id, [3, 4], [0, 2], None), loaded,
                                between=lambda layer: time.sleep(0.005))  # the CPU's attention
        assert result.logits.shape == (2, loaded.config.vocab_size)
    steps_during_assist = engine.num_steps
    stop.set()
    thread.join(WAIT_S)
    assert "result" in box, box
    assert steps_during_assist > 0
    assert handoff.num_handoffs > 0


def test_gated_iteration_still_holds_the_device_from_begin_to_result(loaded) -> None:
    handoff = DeviceHandoff()
    gate = IterationGate()
    session = DenseAssistExecutor(loaded.model, handoff, gate).new_session()
    reply = session.begin(AssistBegin(1, [3], [0], None, wait_for_engine_iteration=True))
    assert handoff.lock.locked()  # across the CPU's attention, as before: GPU and CPU take turns
    width = loaded.config.num_heads * loaded.config.head_dim
    while isinstance(reply, AssistQkv):
        assert handoff.lock.locked()
        reply = session.attention_output(AssistAttentionOutput(1, reply.layer, torch.zeros(1, width)))
    assert isinstance(reply, AssistResult)
    assert not handoff.lock.locked()


def test_a_gated_begin_is_not_handed_the_device_mid_step(loaded) -> None:
    """A gated iteration waits for the engine's step to end (no per-layer handoff)."""
    handoff = DeviceHandoff()
    engine = _Engine(loaded, handoff, layer_pause_s=0.1)
    session = DenseAssistExecutor(loaded.model, handoff).new_session()
    thread, box = _in_thread(engine.step)
    assert engine.at_first_yield.wait(WAIT_S)
    session.begin(AssistBegin(1, [3], [0], None, wait_for_engine_iteration=True))
    # every layer of the engine's step ran before the gated iteration got the device
    assert engine.log.count("engine-layer") == loaded.config.num_layers - 1
    thread.join(WAIT_S)
    assert "result" in box and handoff.num_handoffs == 0
    session.close()
    assert not handoff.lock.locked()


def test_device_wait_budget_is_per_iteration(loaded) -> None:
    """max_device_wait_ms bounds the iteration's waits for the device added over its stages:
    what the first stage waited is charged to the budget, the next stage may wait only what is
    left, and gives up (Overloaded) while the engine still holds the device."""
    budget_ms = 2000
    handoff = DeviceHandoff()
    session = DenseAssistExecutor(loaded.model, handoff).new_session()
    width = loaded.config.num_heads * loaded.config.head_dim

    handoff.lock.acquire()  # the engine holds the device
    stage, box = _in_thread(lambda: session.begin(AssistBegin(1, [3], [0], None, max_device_wait_ms=budget_ms)))
    assert _wait_until(lambda: handoff.num_waiting == 1)  # the stage waits for it
    handoff.lock.release()
    stage.join(WAIT_S)
    reply = box["result"]
    first_wait_s = session.device_wait_s
    assert first_wait_s > 0
    assert session._wait_budget_s == pytest.approx(budget_ms / 1e3 - first_wait_s)  # charged to the iteration

    handoff.lock.acquire()  # the engine takes the device again and keeps it
    try:
        with pytest.raises(Overloaded, match="waited"):
            session.attention_output(AssistAttentionOutput(1, reply.layer, torch.zeros(1, width)))
        assert handoff.lock.locked()  # it gave up: the engine still had the device
    finally:
        handoff.lock.release()
    assert session.device_wait_s >= 0.99 * budget_ms / 1e3  # the two waits used the whole budget
    assert not session.in_iteration  # the iteration was dropped; the client redoes it locally
    assert not handoff.lock.locked()
    # A new iteration has a whole budget again.
    result = _run_iteration(session, AssistBegin(2, [3], [0], None, max_device_wait_ms=budget_ms), loaded)
    assert isinstance(result, AssistResult)


def test_yield_without_waiters_keeps_the_lock() -> None:
    handoff = DeviceHandoff()
    with handoff.lock:
        handoff.yield_to_waiting()
        assert handoff.lock.locked()
    assert handoff.num_handoffs == 0


def test_the_device_changes_hands_only_after_the_holders_work_has_run() -> None:
    """On CUDA `finish_device_work` waits for the queued kernels; it must run while the lock is
    still held, on every hand-over: a yield to a waiting stage and a stage's release."""
    lock_held_when_finished: list[tuple[str, bool]] = []
    holder = ["engine"]
    handoff = DeviceHandoff(finish_device_work=lambda: lock_held_when_finished.append((holder[0], handoff.lock.locked())))
    handoff.lock.acquire()
    stage_done = threading.Event()

    def stage() -> None:
        assert handoff.acquire_stage(WAIT_S)
        holder[0] = "stage"
        handoff.release_stage()
        stage_done.set()

    thread = threading.Thread(target=stage)
    thread.start()
    deadline = time.monotonic() + WAIT_S  # hang guard: wait until the stage is queued
    while handoff.num_waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    handoff.yield_to_waiting()
    assert stage_done.wait(WAIT_S)
    thread.join(WAIT_S)
    handoff.lock.release()
    assert lock_held_when_finished == [("engine", True), ("stage", True)]


def test_steps_that_sample_nothing_wait_for_their_device_work(loaded) -> None:
    from dualpace.engine.runner import ModelRunner
    from dualpace.engine.scheduler import ScheduledSequence, StepPlan
    from dualpace.sampling import SamplingParams

    runner = ModelRunner(loaded, num_blocks=8, block_size=BLOCK_SIZE)
    calls = []
    runner.finish_device_work = lambda: calls.append("finished")
    chunk = ScheduledSequence("r", (5, 6, 7, 8), 0, (0, 1), sample=False, params=SamplingParams(), seed=0)
    assert runner.execute(StepPlan((chunk,))).sampled_token_ids == {}
    assert calls == ["finished"]
