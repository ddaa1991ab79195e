"""Joins (begin.join_engine_iteration) through the real servicer, ring and client, tiny model, fp32.

- a server with a JoinDesk says accepts_join; a dualpace join nobody takes in time runs staged
  (join_info STAGED) and equals the in-process forward;
- a gated join nobody takes ends with DEADLINE_EXCEEDED at the server's stage timeout, nothing is
  held, and the server serves on;
- a join taken by a step (a stand-in for the engine's step thread that drives the desk's joins
  through their ring channels, as B's SplitForward does) returns the same tokens and logits as
  the staged path, with the step's join info;
- a join the step drops (the CPU's attention past the per-layer bound) ends RESOURCE_EXHAUSTED;
- a server without a desk: the client never asks, a gated client runs held.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import grpc
import pytest
import torch

from cpu_service import assist_shm
from cpu_service.assist_client import AssistClient, AssistUnavailable
from cpu_service.assist_join import JoinAsk
from cpu_service.runner import CpuRunner
from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.gate import DeviceHandoff
from dualpace.engine.loop import EngineLoop
from dualpace.engine.runner import ModelRunner
from dualpace.generation import OfflineGenerator
from dualpace.policy.mode_choice import AssistSetting, ExecutionMode, ModeChooser
from dualpace.engine.assist.assist_types import AssistBegin, AssistQkv, JoinHow
from dualpace.engine.assist.join_desk import JoinDesk, JoinOutcome, JoinStepInfo
from dualpace.errors import InvalidArgument, Overloaded
from dualpace.sampling import SamplingParams
from gpu_service.assist_limits import AssistLimits, add_assist_limit_arguments, limits_from_args
from gpu_service.dense_assist import DenseAssistExecutor
from tests.engine.test_migration import stop
from tests.gpu_service.test_dense_assist import (
    HANG_GUARD_S,
    _prefilled,
    _reference_step,
    _ServerThread,
    _zeros_attend,
    loaded,  # noqa: F401 - the module's model fixture
)

pytestmark = pytest.mark.skipif(not assist_shm.shm_doorbell.SUPPORTED, reason="shared memory needs Linux x86-64")
DUALPACE_JOIN = JoinAsk.dualpace(max_join_wait_ms=2.0)


class _StepStandIn:
    """Takes the desk's joins and runs each through its channel, remote rows only (S0 and D1
    empty): the exchange the engine's step thread drives. layer_bound_s: how long a layer waits
    for a join's attention before it drops the join."""

    def __init__(self, desk: JoinDesk, model, layer_bound_s: float = HANG_GUARD_S):
        self.desk, self.model, self.layer_bound_s = desk, model, layer_bound_s
        self.num_steps = 0
        self.dropped = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        desk.on_pending(self._wake.set)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _StepStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(HANG_GUARD_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if not self.desk.has_pending:
                continue
            joins = self.desk.take(max_rows=64)
            self.num_steps += 1
            start_ns = time.monotonic_ns()
            for join in joins:
                self._run_join(join, start_ns)
            self.desk.end_step()

    @torch.inference_mode()
    def _run_join(self, join, start_ns: int) -> None:
        model, begin, channel = self.model, join.begin, join.channel
        hidden = model.embed(torch.tensor(begin.token_ids))
        rope = model.rope_angles(torch.tensor(begin.positions))
        for layer in range(model.config.num_layers):
            q, k, v = model.pre_attention(layer, hidden, rope)
            channel.send_qkv(layer, q, k, v)
            attention = channel.receive_attention(layer, time.monotonic() + self.layer_bound_s)
            if attention is None:
                error = Overloaded(f"no attention output for layer {layer} within the bound")
                channel.fail(error)
                self.desk.settle(join, JoinOutcome.DROPPED, error)
                self.dropped.set()
                return
            hidden = model.post_attention(layer, hidden, attention)
            self.desk.step_progress(layer, 0.0)
        info = JoinStepInfo(engine_step_id=self.num_steps, how="joined", gpu_wait_us=0,
                            step_start_ns=start_ns, step_end_ns=time.monotonic_ns())
        channel.finish(model.logits(hidden).float(), info)
        self.desk.settle(join, JoinOutcome.TAKEN_DONE)


def _server(loaded, desk: JoinDesk | None, stage_timeout_s: float = 5.0) -> _ServerThread:  # noqa: F811
    running = _ServerThread(DenseAssistExecutor(loaded.model, stage_timeout_s=stage_timeout_s, desk=desk))
    running.limits = AssistLimits(stage_timeout_s=stage_timeout_s)
    return running.start()


def _decode_steps(client: AssistClient, loaded, join: JoinAsk, num_steps: int, sampling=None):  # noqa: F811
    """num_steps assisted decode steps of three sequences, each checked against the in-process
    forward; the outputs and each step's join info."""
    host, reference, token_ids = _prefilled(loaded, num_steps)
    outputs, infos = [], []
    for _ in range(num_steps):
        host.lengths = [n + 1 for n in host.lengths]
        positions = [n - 1 for n in host.lengths]
        output = client.run_iteration(token_ids, positions, host.attend, sampling, join=join)
        expected = _reference_step(reference, host, token_ids)
        if sampling is None:
            assert (output - expected).abs().max().item() < 1e-5
        else:
            assert output == expected.argmax(dim=1).tolist()  # greedy rows
        token_ids = expected.argmax(dim=1).tolist()
        outputs.append(output)
        infos.append(client.last_join_info)
    return outputs, infos


def test_a_join_not_taken_in_time_runs_staged(loaded) -> None:  # noqa: F811
    running = _server(loaded, JoinDesk(loaded.config.num_layers))
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            _, infos = _decode_steps(client, loaded, DUALPACE_JOIN, 3)
            assert client._shm is not None and client._shm.accepts_join
            assert all(info is not None and info.how == JoinHow.STAGED for info in infos)
            assert client.num_shm_iterations == 3
    finally:
        running.stop()


def test_a_stalled_gated_join_ends_deadline_exceeded_and_the_server_serves_on(loaded) -> None:  # noqa: F811
    desk = JoinDesk(loaded.config.num_layers)
    running = _server(loaded, desk, stage_timeout_s=0.5)
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            with pytest.raises(AssistUnavailable) as raised:  # no engine step takes it
                client.run_iteration([1], [0], _zeros_attend(loaded), wait_for_engine_iteration=True,
                                     join=JoinAsk.gated())
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert not desk.has_pending and not running.executor.device_lock.locked()
            with _StepStandIn(desk, loaded.model):  # an engine that steps again: the next join rides in it
                _, infos = _decode_steps(client, loaded, JoinAsk.gated(), 2)
            assert [info.how for info in infos] == [JoinHow.JOINED] * 2
    finally:
        running.stop()


def test_a_taken_join_equals_the_staged_path(loaded) -> None:  # noqa: F811
    desk = JoinDesk(loaded.config.num_layers)
    running = _server(loaded, desk)
    greedy = [(SamplingParams(), seed) for seed in (1, 2, 3)]
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            staged_logits, _ = _decode_steps(client, loaded, DUALPACE_JOIN, 3)
            staged_tokens, _ = _decode_steps(client, loaded, DUALPACE_JOIN, 3, greedy)
            patient = JoinAsk.dualpace(max_join_wait_ms=HANG_GUARD_S * 1e3)  # no step is running: it waits
            with _StepStandIn(desk, loaded.model) as step:
                joined_logits, infos = _decode_steps(client, loaded, JoinAsk.gated(), 3)
                joined_tokens, _ = _decode_steps(client, loaded, JoinAsk.gated(), 3, greedy)
                dualpace_tokens, dualpace_infos = _decode_steps(client, loaded, patient, 3, greedy)
            assert dualpace_tokens == staged_tokens
            assert [info.how for info in dualpace_infos] == [JoinHow.JOINED] * 3
            assert joined_tokens == staged_tokens
            assert all((a - b).abs().max().item() < 1e-5 for a, b in zip(joined_logits, staged_logits))
            assert [info.how for info in infos] == [JoinHow.JOINED] * 3
            assert [info.engine_step_id for info in infos] == [1, 2, 3] and step.num_steps == 9
            assert all(0 < info.step_start_ns <= info.step_end_ns for info in infos)
    finally:
        running.stop()


def test_a_join_the_step_drops_ends_resource_exhausted(loaded) -> None:  # noqa: F811
    desk = JoinDesk(loaded.config.num_layers)
    running = _server(loaded, desk)
    zeros = _zeros_attend(loaded)
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            with _StepStandIn(desk, loaded.model, layer_bound_s=0.2) as step:
                def stalled_attend(layer, q, k, v):
                    if layer == 1:  # the CPU stalls past the step's per-layer bound
                        assert step.dropped.wait(HANG_GUARD_S)
                    return zeros(layer, q, k, v)

                with pytest.raises(AssistUnavailable) as raised:
                    client.run_iteration([1], [0], stalled_attend, join=JoinAsk.gated())
                assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert client.run_iteration([1], [0], zeros, join=JoinAsk.gated()).shape[0] == 1  # a fresh stream
                assert client.last_join_info.how == JoinHow.JOINED
            assert not desk.has_pending
    finally:
        running.stop()


def test_a_server_without_a_desk_is_never_asked(loaded) -> None:  # noqa: F811
    running = _server(loaded, None)
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            _, infos = _decode_steps(client, loaded, JoinAsk.gated(), 2)
            assert client._shm is not None and not client._shm.accepts_join
            assert infos == [None, None] and client._downgrades.num_downgraded == 2
            logits = client.run_iteration([1], [0], _zeros_attend(loaded), wait_for_engine_iteration=True,
                                          join=JoinAsk.gated())  # gated downgraded to held: still served
            assert logits.shape == (1, loaded.config.vocab_size)
    finally:
        running.stop()


class _Timeline:
    """Collects the engine loop's step records (the fields of dualpace.engine.step_timeline.StepRecord)."""

    def __init__(self):
        self.records: list[dict] = []

    def record_step(self, **fields) -> None:
        self.records.append(fields)


async def _generate_on_cpu_engine(loaded, runner, prompts, params, timeline=None):  # noqa: F811
    config = EngineConfig(name="cpu", kind="cpu", num_kv_blocks=64, block_size=4)
    loop = EngineLoop(EngineCore(loaded, config, runner))
    loop.step_timeline = timeline
    task = asyncio.create_task(loop.run())
    try:
        channels = [await loop.add_request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
        return [[t async for update in channel.follow() for t in update.new_token_ids] for channel in channels]
    finally:
        await stop((loop, task))


@pytest.mark.parametrize("policy", ["gated", "dualpace"])
async def test_the_cpu_engine_records_its_joined_iterations_as_cooperative(loaded, policy) -> None:  # noqa: F811
    """CpuRunner end to end against a server whose step takes every join: gated joins every decode
    iteration (none staged or held, none local); dualpace may join once the chooser has learnt
    that the server can (whether a step takes it within its slack is timing, not asserted); the
    tokens equal the offline reference's either way, with no fallback."""
    desk = JoinDesk(loaded.config.num_layers)
    running = _server(loaded, desk)
    prompts, params = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2]], SamplingParams(max_tokens=12, ignore_eos=True)
    setting = AssistSetting.ALWAYS if policy == "gated" else AssistSetting.AUTO
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client, \
                _StepStandIn(desk, loaded.model):
            runner = CpuRunner(loaded, 64, 4, ModeChooser(setting, assist_configured=True), client,
                               gated=policy == "gated")
            outputs = await _generate_on_cpu_engine(loaded, runner, prompts, params)
        expected = [s.output_token_ids for s in OfflineGenerator(loaded, block_size=4).generate(prompts, [params] * 2)]
        assert outputs == expected
        assert runner.num_assist_fallbacks == 0 and runner.chooser.cooperative_configured
        by_mode = runner.num_steps_by_mode
        if policy == "gated":  # every decode iteration rode in a GPU step; only the prefills ran here
            assert by_mode[ExecutionMode.COOPERATIVE] > 0 and by_mode[ExecutionMode.ASSISTED] == 0
            assert by_mode[ExecutionMode.LOCAL] <= len(prompts)
    finally:
        running.stop()


def test_join_flags_parse_and_bad_values_are_refused() -> None:
    parser = argparse.ArgumentParser()
    add_assist_limit_arguments(parser)
    limits = limits_from_args(parser.parse_args(["--assist-join", "off", "--assist-join-min-layer-wait-ms", "7.5"]))
    assert limits.join_enabled is False and limits.join_min_layer_wait_ms == 7.5
    assert limits_from_args(parser.parse_args([])).join_enabled is True
    with pytest.raises(InvalidArgument, match="--assist-join-min-layer-wait-ms"):
        limits_from_args(parser.parse_args(["--assist-join-min-layer-wait-ms", "0"]))


@pytest.mark.parametrize("policy", ["gated", "dualpace"])
async def test_joins_ride_in_a_real_gpu_engine_beside_its_own_requests(loaded, policy) -> None:  # noqa: F811
    """The GPU engine (ModelRunner with the desk, EngineLoop) serving its own requests while the CPU
    engine's iterations join its steps: both engines' tokens equal the offline reference, gated
    ran every CPU decode iteration inside a GPU step, and nothing fell back."""
    device_lock = threading.Lock()
    gpu_runner = ModelRunner(loaded, 64, 4)
    desk = JoinDesk(loaded.config.num_layers)
    gpu_runner.set_join_desk(desk)
    gpu_loop = EngineLoop(EngineCore(loaded, EngineConfig(name="gpu", kind="gpu", num_kv_blocks=64, block_size=4),
                                     gpu_runner), step_lock=device_lock)
    handoff = DeviceHandoff(device_lock, gpu_runner.finish_device_work)
    gpu_runner.forward.between_layers = handoff.yield_to_waiting
    running = _ServerThread(DenseAssistExecutor(loaded.model, handoff, gpu_loop.gate, desk=desk)).start()
    gpu_timeline, cpu_timeline = _Timeline(), _Timeline()
    gpu_loop.step_timeline = gpu_timeline
    gpu_task = asyncio.create_task(gpu_loop.run())
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    gpu_prompts, cpu_prompts = [[8, 6, 4, 2, 1], [2, 7, 1, 8]], [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2]]
    setting = AssistSetting.ALWAYS if policy == "gated" else AssistSetting.AUTO
    try:
        with AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S) as client:
            cpu_runner = CpuRunner(loaded, 64, 4, ModeChooser(setting, assist_configured=True), client,
                                   gated=policy == "gated")
            gpu_channels = [await gpu_loop.add_request(f"g{i}", p, params) for i, p in enumerate(gpu_prompts)]
            cpu_outputs = await _generate_on_cpu_engine(loaded, cpu_runner, cpu_prompts, params, cpu_timeline)
            gpu_outputs = [[t async for update in c.follow() for t in update.new_token_ids] for c in gpu_channels]
        reference = OfflineGenerator(loaded, block_size=4)
        assert cpu_outputs == [s.output_token_ids for s in reference.generate(cpu_prompts, [params] * 2)]
        assert gpu_outputs == [s.output_token_ids for s in reference.generate(gpu_prompts, [params] * 2)]
        assert cpu_runner.num_assist_fallbacks == 0 and not desk.has_pending
        by_mode = cpu_runner.num_steps_by_mode
        if policy == "gated":  # dualpace joins only where a step begins within its slack: timing, not asserted
            # (under the full suite's load a dualpace run may well join no step at all)
            assert desk.num_steps > 0
            assert by_mode[ExecutionMode.COOPERATIVE] > 0 and by_mode[ExecutionMode.ASSISTED] == 0
        # Identity, not timing: each cooperative CPU iteration names a GPU step whose record lists it.
        joins_by_step = {r["step_id"]: {j.iteration_id for j in r["joins"]} for r in gpu_timeline.records}
        cooperative = [r for r in cpu_timeline.records if r["mode"] == "cooperative"]
        assert len(cooperative) == by_mode[ExecutionMode.COOPERATIVE]
        for record in cooperative:
            assert record["iteration_id"] in joins_by_step[record["engine_step_id"]], record
            assert record["how"] in ("JOINED", "SPLIT") and record["attention_ns"] > 0
    finally:
        running.stop()
        await stop((gpu_loop, gpu_task))


def test_a_join_without_a_ring_channel_runs_staged_or_held(loaded) -> None:  # noqa: F811
    """Over gRPC (no ring channel) a join is not offered: dualpace runs staged, gated runs held."""
    desk = JoinDesk(loaded.config.num_layers)
    executor = DenseAssistExecutor(loaded.model, desk=desk)
    session = executor.new_session()
    assert session.accepts_join and not executor.new_session().in_iteration
    staged = AssistBegin(1, [1], [0], None, join_engine_iteration=True, max_join_wait_us=1000)
    assert isinstance(session.begin(staged), AssistQkv) and not executor.device_lock.locked()
    session.close()
    held = AssistBegin(2, [1], [0], None, wait_for_engine_iteration=True, join_engine_iteration=True)
    assert isinstance(session.begin(held), AssistQkv) and executor.device_lock.locked()  # held to its result
    session.close()
    assert not executor.device_lock.locked() and not desk.has_pending and desk.num_steps == 0


def test_a_dualpace_join_never_asks_for_the_gated_wait_and_fits_the_wire() -> None:
    assert JoinAsk.dualpace(0.0).max_join_wait_us == 1  # 0 on the wire would mean "up to the stage timeout"
    assert JoinAsk.dualpace(1e12).max_join_wait_us == 2**32 - 1
    assert JoinAsk.gated().max_join_wait_us is None and JoinAsk.gated().join


def test_a_client_gone_mid_join_is_dropped_at_once_not_at_the_layer_bound(loaded) -> None:  # noqa: F811
    """The CPU's stream ends mid-join (as when its process dies): the stream's stop interrupts the
    step's wait on the ring, so the join is dropped without waiting out its per-layer bound."""
    desk = JoinDesk(loaded.config.num_layers)
    running = _server(loaded, desk)
    zeros = _zeros_attend(loaded)
    try:
        client = AssistClient(running.address, iteration_timeout_s=HANG_GUARD_S)
        with _StepStandIn(desk, loaded.model, layer_bound_s=10 * HANG_GUARD_S) as step:
            def attend_then_vanish(layer, q, k, v):
                if layer == 1:
                    closing = threading.Thread(target=client._stream.close)  # the call is cancelled
                    closing.start()
                    closing.join(HANG_GUARD_S)
                    assert step.dropped.wait(HANG_GUARD_S)  # long before the bound
                return zeros(layer, q, k, v)

            with pytest.raises(AssistUnavailable):
                client.run_iteration([1], [0], attend_then_vanish, join=JoinAsk.gated())
            assert client.run_iteration([1], [0], zeros, join=JoinAsk.gated()).shape[0] == 1  # a fresh stream
        client.close()
        assert not desk.has_pending
    finally:
        running.stop()
