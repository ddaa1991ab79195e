"""The CPU engine's runner: each iteration Local, Assisted or Cooperative, chosen per iteration.

A failed assisted iteration is redone locally in the same step, so no request
is lost or corrupted when gpu_service is unreachable, slow or dies mid-iteration. A failure backs
the chooser off; a refusal because the GPU is busy (RESOURCE_EXHAUSTED) is learnt as a latency.

Cooperative: the iteration asks gpu_service to run its
dense rows inside the GPU engine's next step (a join). dualpace asks when the ModeChooser picks
COOPERATIVE, waiting at most its slack for the step; gated asks for every decode iteration and
waits up to the server's stage timeout (a server that cannot join it holds the GPU from begin to
result instead). A step is counted under the mode that ran:
COOPERATIVE when the server's join info says the rows rode in its step, else ASSISTED; the
chooser learns a join ask's latency as cooperative either way (ModeChooser.record_cooperative).
"""

from __future__ import annotations

import logging
import time

import grpc

from cpu_service.assist_client import AssistClient, AssistUnavailable
from cpu_service.assist_join import NO_JOIN, JoinAsk, ran_in_engine_step
from cpu_service.assisted_forward import AssistedForward
from dualpace.engine.runner import ModelRunner
from dualpace.engine.scheduler import StepPlan, StepResult
from dualpace.engine.step_timeline import assisted_record_fields
from dualpace.model.loader import LoadedModel
from dualpace.policy.mode_choice import AssistSetting, ExecutionMode, ModeChooser
from dualpace.serve.metrics import DENSE_ASSIST_CALLS, DENSE_ASSIST_ROUND_TRIP

log = logging.getLogger(__name__)
DEVICE_MODES = (ExecutionMode.ASSISTED, ExecutionMode.COOPERATIVE)


class CpuRunner(ModelRunner):
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, chooser: ModeChooser,
                 client: AssistClient | None = None, gated: bool = False, engine_name: str = "cpu",
                 kv_memory=None, num_window_blocks: int = 0):
        super().__init__(loaded, num_blocks, block_size, kv_memory, num_window_blocks=num_window_blocks)
        self.chooser = chooser
        self.client = client
        self.gated = gated  # gated as NEO: every iteration joins the GPU's step
        self.assisted = None if client is None else AssistedForward(self.kv, loaded.config, client, gated)
        self.num_steps_by_mode = {mode: 0 for mode in ExecutionMode}
        self.num_assist_fallbacks = 0
        self.last_mode = ExecutionMode.LOCAL
        # Prometheus: the EngineLoop observes iteration latency by last_mode; Dense Assist is counted here.
        self._assist_ok = DENSE_ASSIST_CALLS.labels(engine_name, "ok")
        self._assist_fallback = DENSE_ASSIST_CALLS.labels(engine_name, "fallback")
        self._assist_round_trip = DENSE_ASSIST_ROUND_TRIP.labels(engine_name)

    def run_plan(self, plan: StepPlan) -> StepResult:
        """A non-empty plan, Assisted or Local (ModelRunner.execute counts the step and honours faults)."""
        decode_only = all(len(s.token_ids) == 1 and s.sample for s in plan.sequences)
        mode = self.chooser.choose(len(plan.sequences), decode_only)
        # The assisted path samples on the GPU server, which has no token masks: constrained
        # (structured-output) requests always run their steps here.
        guided = any(s.params.guided is not None for s in plan.sequences)
        self.last_step_record_fields = {}  # what the step's StepRecord learns from here (EngineLoop)
        refused = None  # (the device mode chosen, its start) when the GPU server refused it as busy
        if mode in DEVICE_MODES and self.assisted is not None and not guided:
            batch_size = len(plan.sequences)
            join = self._join_ask(mode, batch_size)
            start = time.perf_counter()
            try:  # the device budget bounds staged or held stages; a gated join waits for the GPU step itself
                result = self.assisted.execute(plan, self.chooser.max_device_wait_ms(batch_size), join)
            except AssistUnavailable as exc:
                self.num_assist_fallbacks += 1
                self._assist_fallback.inc()
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the GPU was busy past the budget
                    refused = (ExecutionMode.COOPERATIVE if join.join else ExecutionMode.ASSISTED, start)
                else:
                    self.chooser.record_assist_failure()
                log.warning("assisted iteration failed (%s); redoing it locally", exc)
            else:
                self._assist_ok.inc()
                self._assist_round_trip.observe(time.perf_counter() - start)
                info = self.client.last_join_info  # set when a joining server handled a join ask
                ran = ExecutionMode.COOPERATIVE if ran_in_engine_step(info) else ExecutionMode.ASSISTED
                self._record(ran, batch_size, start, asked_to_join=info is not None)
                self.last_step_record_fields = assisted_record_fields(  # for the step timeline
                    self.client.last_iteration_id, self.client.last_join_info, self.assisted.last_attention_ns,
                    self.assisted.last_runqueue_delay_ns)
                return result
            finally:
                self.chooser.cooperative_configured = self.client.peer_accepts_join
        start = time.perf_counter()
        result = super().run_plan(plan)
        self._record(ExecutionMode.LOCAL, len(plan.sequences), start)
        if refused is not None:  # learnt as the chosen mode's latency, the refusal and redo included
            self.chooser.record_device_busy(refused[0], len(plan.sequences), (time.perf_counter() - refused[1]) * 1e3)
        return result

    def _join_ask(self, mode: ExecutionMode, batch_size: int) -> JoinAsk:
        if self.gated:
            return JoinAsk.gated()
        if mode == ExecutionMode.COOPERATIVE:
            if self.chooser.setting == AssistSetting.ALWAYS:  # dualpace --assist always: no local to beat
                return JoinAsk.dualpace(self.chooser.max_device_wait_ms(batch_size))
            return JoinAsk.dualpace(self.chooser.max_join_wait_ms(batch_size))  # its slack against local
        return NO_JOIN

    def _record(self, mode: ExecutionMode, batch_size: int, start_s: float, asked_to_join: bool = False) -> None:
        """Count the step under the mode that ran; the chooser learns a join ask's outcome as
        cooperative whatever ran (and a staged run as assisted too: record_cooperative)."""
        latency_ms = (time.perf_counter() - start_s) * 1e3
        if asked_to_join:
            self.chooser.record_cooperative(batch_size, latency_ms, ran_staged=mode == ExecutionMode.ASSISTED)
        else:
            self.chooser.record(mode, batch_size, latency_ms)
        self.num_steps_by_mode[mode] += 1
        if mode != self.last_mode or self.num_steps_by_mode[mode] == 1:
            log.info("iterations now run %s (batch %d; steps so far: %s)", mode.value, batch_size,
                     {m.value: n for m, n in self.num_steps_by_mode.items()})
        self.last_mode = mode
