"""The CPU engine's runner: each iteration Local or Assisted, chosen per iteration.

A failed assisted iteration is redone locally in the same step, so no request
is lost or corrupted when gpu_service is unreachable, slow or dies mid-iteration.
"""

from __future__ import annotations

import logging
import time

from cpu_service.assist_client import AssistClient, AssistUnavailable
from cpu_service.assisted_forward import AssistedForward
from dualpace.engine.runner import ModelRunner
from dualpace.engine.scheduler import StepPlan, StepResult
from dualpace.model.loader import LoadedModel
from dualpace.policy.mode_choice import ExecutionMode, ModeChooser
from dualpace.serve.metrics import DENSE_ASSIST_CALLS, DENSE_ASSIST_ROUND_TRIP

log = logging.getLogger(__name__)


class CpuRunner(ModelRunner):
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, chooser: ModeChooser,
                 client: AssistClient | None = None, gated: bool = False, engine_name: str = "cpu",
                 kv_memory=None):
        super().__init__(loaded, num_blocks, block_size, kv_memory)
        self.chooser = chooser
        self.client = client
        self.assisted = None if client is None else AssistedForward(self.kv, loaded.config.head_dim, client, gated)
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
        if mode == ExecutionMode.ASSISTED and self.assisted is not None and not guided:
            start = time.perf_counter()
            try:
                result = self.assisted.execute(plan, self.chooser.max_device_wait_ms(len(plan.sequences)))
            except AssistUnavailable as exc:
                self.num_assist_fallbacks += 1
                self._assist_fallback.inc()
                self.chooser.record_assist_failure()
                log.warning("assisted iteration failed (%s); redoing it locally", exc)
            else:
                self._assist_ok.inc()
                self._assist_round_trip.observe(time.perf_counter() - start)
                self._record(ExecutionMode.ASSISTED, len(plan.sequences), start)
                return result
        start = time.perf_counter()
        result = super().run_plan(plan)
        self._record(ExecutionMode.LOCAL, len(plan.sequences), start)
        return result

    def _record(self, mode: ExecutionMode, batch_size: int, start_s: float) -> None:
        self.chooser.record(mode, batch_size, (time.perf_counter() - start_s) * 1e3)
        self.num_steps_by_mode[mode] += 1
        if mode != self.last_mode or self.num_steps_by_mode[mode] == 1:
            log.info("iterations now run %s (batch %d; steps so far: %s)", mode.value, batch_size,
                     {m.value: n for m, n in self.num_steps_by_mode.items()})
        self.last_mode = mode
