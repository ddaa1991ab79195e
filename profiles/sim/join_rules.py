"""The dualpace policy's join rules in the simulator (SimConfig.join_rule; the decisions are
dualpace.policy.join_rule's, the daemons' pure code):

- "within-layer": a cooperative iteration joins the next GPU step only when it begins within one
  GPU layer, else runs staged (profiles/sim/cooperative.py, as designed first);
- "meet": the iteration starts locally at once (a Local iteration on the CPU's clock); when a GPU
  step's layer clock meets the CPU's (join_rule.meeting_point: the running step, checked now, or a
  step that starts before the local iteration ends, checked at its start), its rows ride in that
  step from the meeting layer on; the step's remaining layers each take the planner's joined layer
  time (plan_layout: JOINED or SPLIT; a STAGED answer means no join) and the CPU iteration ends
  with the step; with an ITL target (SimConfig.itl_target_ms) no join takes a step past it;
- "meet-net": "meet" where the CPU's rows gain more tokens per ms than the step's own rows lose;
- "slack": join the next step while the wait is within the chooser's slack, else run locally.

A part of profiles.sim.simulator.Simulator (mixed in, like Cooperative). Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dualpace.engine.scheduler import StepPlan
from dualpace.policy.cooperative_plan import JoinHow
from dualpace.policy.join_rule import JoinAction, JoinRule, TokenRates, join_action, meeting_point
from dualpace.profile.cost_model import DecodeBatch, cpu_join_layer_ms
from profiles.sim.config import GPU
from profiles.sim.cooperative import PendingJoin

_EPS_MS = 1e-9


@dataclass
class Meeting:
    """A cooperative iteration running locally until a GPU step meets it (rule "meet")."""

    batch: int
    started_ms: float
    local_ms: float  # the whole local iteration
    cpu_join_layer_ms: float  # its attention + ring time per layer once joined
    met: bool = False


class JoinRules:
    """Simulator methods for the join rules (mixed into Simulator)."""

    meeting: Meeting | None = None

    def _cooperative_action(self, batch: int) -> JoinAction:
        gpu = self.engines[GPU]
        if gpu.busy:
            wait_ms = self.device.wait_ms(self.now_ms)
        else:
            wait_ms = 0.0 if gpu.scheduler.has_work else None
        layer_ms = self.device.engine_layer_ms() if gpu.busy else 0.0
        return join_action(self.config.join_rule, wait_ms, layer_ms, self.chooser.max_join_wait_ms(batch))

    def _start_meeting(self, cpu, plan: StepPlan, decode: DecodeBatch, local_ms: float) -> None:
        self.meeting = Meeting(decode.batch, self.now_ms, local_ms, cpu_join_layer_ms(self.cost, decode))
        self._start(cpu, plan, self.now_ms + local_ms + self.config.engine_overhead_ms)
        run = self.device.engine_run
        gpu = self.engines[GPU]
        if gpu.busy and gpu.plan is not None and run is not None and self.device.held_until_ms <= self.now_ms:
            layer0_ms = run.resumed_at_ms - run.work_done_at_resume_ms - self.now_ms
            point = self._meeting_point(gpu.plan, layer0_ms, run.layer_ms, run.work_ms)
            if point is not None:
                extra_ms, layer, wait_ms = point
                run.end_ms += extra_ms
                run.work_ms += extra_ms
                gpu.done_version += 1
                self._push(run.end_ms + self.config.engine_overhead_ms, "done", (GPU, gpu.done_version))
                self._met(layer, wait_ms, run.end_ms)

    def _start_with_meeting(self, gpu, plan: StepPlan, gpu_ms: float) -> bool:
        """A GPU step starts now while a meeting is pending: start it with the rows from the
        meeting layer on, if it meets them (True), else leave it to the caller (False)."""
        if self.meeting is None or self.meeting.met:
            return False
        point = self._meeting_point(plan, self.now_ms - self.meeting.started_ms, gpu_ms / self.num_layers, gpu_ms)
        if point is None:
            return False
        extra_ms, layer, wait_ms = point
        end_ms = self.device.start_engine(self.now_ms, gpu_ms + extra_ms)
        self._start(gpu, plan, end_ms + self.config.engine_overhead_ms)
        self._met(layer, wait_ms, end_ms)
        return True

    def _meeting_point(self, plan: StepPlan, layer0_ms: float, gpu_layer_ms: float, gpu_step_ms: float):
        """(the step's extra time, the meeting layer, the CPU's wait) or None. layer0_ms: when the
        step began (or begins) its layer 0, relative to the CPU iteration's start."""
        meeting = self.meeting
        prefill_tokens, contexts, num_sampled = self._plan_shape(plan)
        join = PendingJoin(meeting.batch, 0.0, 0.0, meeting.cpu_join_layer_ms, meeting.started_ms)
        layout, own_layer_ms = self._plan_join(prefill_tokens, contexts, join)
        if layout.how is JoinHow.STAGED:
            return None  # the planner would not take the rows: the CPU runs on locally
        extra_layer_ms = max(0.0, layout.predicted_layer_ms - own_layer_ms)
        cpu_layer_ms = meeting.local_ms / self.num_layers
        elapsed_ms = self.now_ms - meeting.started_ms
        done_layers = math.ceil(elapsed_ms / cpu_layer_ms - _EPS_MS) if cpu_layer_ms > 0 else self.num_layers
        rates = TokenRates(num_sampled, gpu_step_ms, meeting.batch) if self.config.join_rule == JoinRule.MEET_NET else None
        point = meeting_point(layer0_ms, gpu_layer_ms, extra_layer_ms, cpu_layer_ms, self.num_layers,
                              meeting.local_ms, done_layers, rates, self.config.itl_target_ms, gpu_step_ms)
        if point is None:
            return None
        self._meeting_how = layout.how
        return (self.num_layers - point.layer) * extra_layer_ms, point.layer, point.cpu_wait_ms

    def _met(self, layer: int, wait_ms: float, step_end_ms: float) -> None:
        cpu = self._cpu_engine()
        self.meeting.met = True
        self.num_joined_iterations += 1
        self.num_split_iterations += self._meeting_how is JoinHow.SPLIT
        self.num_layers_shared += self.num_layers - layer
        self.join_wait_ms_total += wait_ms
        cpu.done_version += 1  # it ends with the step, not as the local iteration would
        self._push(step_end_ms + self.config.engine_overhead_ms, "done", (cpu.name, cpu.done_version))

    def _meeting_done(self, cpu) -> bool:
        """The CPU iteration of a meeting ended: record it (True), or there was none (False)."""
        meeting, self.meeting = self.meeting, None
        if meeting is None:
            return False
        latency_ms = self.now_ms - cpu.started_ms - self.config.engine_overhead_ms
        self.chooser.record_cooperative(meeting.batch, latency_ms, ran_staged=False, ran_local=not meeting.met)
        if meeting.met:
            cpu.num_assisted += 1
        else:
            cpu.num_local += 1
            self.num_joins_declined_to_local += 1
        return True

    def _unmet_local(self, cpu, plan: StepPlan, batch: int, local_ms: float) -> None:
        """The rule found no step to join in time ("slack"): the iteration runs locally."""
        self.num_joins_declined_to_local += 1
        cpu.num_local += 1
        self.chooser.record_cooperative(batch, local_ms, ran_staged=False, ran_local=True)
        self._start(cpu, plan, self.now_ms + local_ms + self.config.engine_overhead_ms)
