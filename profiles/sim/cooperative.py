"""Cooperative execution (assist hold "cooperative"), as built: an Assisted CPU iteration's decode
rows join the GPU engine's next step as remote rows.

The GPU step's layout is the daemons' own call, dualpace.policy.cooperative_plan.plan_layout, on
per-layer costs from the profile (dualpace.profile.cost_model.layer_costs_of_profile, the same
constructor the runner's measured LayerTimes go through). Per layer the step takes
`pre(S1) + max(layer(S0) + attend(D1), cpu_layer(R)) + post(S1)`: the CPU's attention of layer l
overlaps only S0's layer l and D1's attention, not the whole step, because the remote rows'
post_attention(l) waits for it. The simulated step lasts the profile's own-step time plus the
layout's extra per-layer time over all layers; the CPU iteration ends with the step.

- dualpace: the CPU's rows join only when the GPU's next step begins within one GPU layer (the GPU
  engine has work and the device is free, or the running step is in its last layer), as
  gpu_service's JoinDesk declines a late offer; else its dense stages go staged at the GPU's layer
  boundaries. The planner may also decline (STAGED) when staged stages lengthen the step less. A cooperative request's latency is recorded as COOPERATIVE, and as
  ASSISTED too when it ran staged (ModeChooser.record_cooperative), so the chooser learns both.
- gated (NEO as built): every decode-only CPU iteration joins; the planner picks the layout with
  the least GPU wait (SPLIT: the other sub-batch covers the CPU's attention). With nothing of its
  own to run the GPU engine still runs a step for the join alone; the device is never held
  through the CPU's attention by a block.

A part of profiles.sim.simulator.Simulator (mixed in, like CpuSteps). Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpace.engine.scheduler import StepPlan
from dualpace.policy.cooperative_plan import JoinHow, OwnRows, RemoteJoin, own_step_layer_ms, plan_layout
from dualpace.profile.cost_model import DecodeBatch, cpu_join_layer_ms, layer_costs_of_profile
from profiles.sim.config import GPU


@dataclass
class PendingJoin:
    """An Assisted CPU iteration waiting for the GPU engine's next step."""

    batch: int  # the CPU's decode rows
    device_ms: float  # its dense work alone on the device (a separate, staged pass)
    cpu_side_ms: float  # its attention and round trips, over all layers (staged)
    cpu_layer_ms: float  # its attention + ring time per layer when joined (expected_layer_us)
    asked_ms: float = 0.0  # when the CPU asked (its wait for the step is counted from here)


class Cooperative:
    """Simulator methods for joined steps (mixed into Simulator)."""

    pending_join: PendingJoin | None = None
    num_cooperative_choices = 0  # CPU iterations the chooser sent as cooperative
    num_joined_iterations = 0  # GPU steps that carried a CPU iteration's rows (JOINED or SPLIT)
    num_split_iterations = 0  # of those, SPLIT (S0 non-empty)
    num_joins_declined_to_staged = 0  # not taken in time (dualpace) or the planner declined: staged
    join_wait_ms_total = 0.0  # the CPU's waits for the shared layer, over all joins
    num_layers_shared = 0  # layers in which remote rows shared the GPU's dense pass, over all joins
    # how the CPU's running assisted iteration is recorded: (asked to join, ran staged)
    cpu_joining, cpu_ran_staged = False, True
    _layer_costs = None

    def _join_next_gpu_iteration(self, cpu, plan: StepPlan, decode: DecodeBatch, assisted_ms: float) -> None:
        device_ms = self._assist_device_ms(decode.batch)
        cpu.busy = True
        cpu.plan = plan
        cpu.started_ms = self.now_ms
        cpu.num_iterations += 1
        cpu.num_assisted += 1
        cpu.staged_batch = decode.batch  # its latency, wait included, is recorded when it ends
        self.cpu_joining, self.cpu_ran_staged = True, False
        self.pending_join = PendingJoin(decode.batch, device_ms, max(0.0, assisted_ms - device_ms),
                                        cpu_join_layer_ms(self.cost, decode), self.now_ms)

    def _plan_join(self, prefill_tokens: int, contexts: list[int], pending: PendingJoin | None = None):
        """(the planner's layout for `pending` (default: the pending join), the layer time of the
        step without the join)."""
        if self._layer_costs is None:
            self._layer_costs = layer_costs_of_profile(self.cost)
        own = OwnRows(prefill_tokens, contexts)
        pending = pending or self.pending_join
        join = RemoteJoin(pending.batch, pending.cpu_layer_ms)
        return plan_layout(self.config.policy, own, [join], self._layer_costs), own_step_layer_ms(own, self._layer_costs)

    def _start_with_join(self, gpu, plan: StepPlan, gpu_ms: float, prefill_tokens: int, contexts: list[int]) -> None:
        """The GPU step starts now with the pending join on offer: joined or split as planned
        (both end together), or declined and the CPU's rows go staged inside the step."""
        layout, own_layer_ms = self._plan_join(prefill_tokens, contexts)
        if layout.how is JoinHow.STAGED:
            end_ms = self.device.start_engine(self.now_ms, gpu_ms)
            self._start(gpu, plan, end_ms + self.config.engine_overhead_ms)
            self._stage_pending_join()
            return
        extra_ms = self.num_layers * max(0.0, layout.predicted_layer_ms - own_layer_ms)
        self.num_split_iterations += layout.how is JoinHow.SPLIT
        self._start_joined(gpu, plan, gpu_ms + extra_ms)

    def _start_joined(self, gpu, plan: StepPlan, duration_ms: float) -> None:
        """Both engines' iterations start now and end together."""
        cpu = self._cpu_engine()
        self._count_full_join()
        end_ms = self.device.start_engine(self.now_ms, duration_ms)
        self._start(gpu, plan, end_ms + self.config.engine_overhead_ms)
        cpu.done_version += 1
        self._push(end_ms + self.config.engine_overhead_ms, "done", (cpu.name, cpu.done_version))

    def _run_join_alone(self) -> None:
        """The GPU engine has nothing of its own to run. gated: it runs a step for the join alone
        (the device busy for the step, the GPU waiting on the CPU's attention in each layer);
        dualpace: the planner declines and the rows take the device stage by stage."""
        layout, _ = self._plan_join(0, [])
        if layout.how is JoinHow.STAGED:
            self._stage_pending_join()
            return
        cpu = self._cpu_engine()
        self._count_full_join()
        end_ms = self.device.start_engine(self.now_ms, self.num_layers * layout.predicted_layer_ms)
        run = self.device.engine_run
        self._push(end_ms, "call", lambda: self._end_join_alone(run))
        cpu.done_version += 1
        self._push(end_ms + self.config.engine_overhead_ms, "done", (cpu.name, cpu.done_version))

    def _count_full_join(self) -> None:
        """The pending join rides in the step starting now, from its layer 0."""
        self.num_joined_iterations += 1
        self.num_layers_shared += self.num_layers
        self.join_wait_ms_total += self.now_ms - self.pending_join.asked_ms
        self.pending_join = None

    def _end_join_alone(self, run) -> None:
        if self.device.engine_run is run:  # no engine step of its own started since (it cannot before the end)
            self.device.engine_finished()

    def _stage_pending_join(self) -> None:
        join, self.pending_join = self.pending_join, None
        self.num_joins_declined_to_staged += 1
        self.cpu_ran_staged = True  # a staged run of a cooperative request
        num_stages = self.num_layers + 1
        self._next_stage(self._cpu_engine(), num_stages, join.device_ms / num_stages, join.cpu_side_ms / self.num_layers,
                         self._stage_budget_ms(join.batch))

    def _cpu_engine(self):
        return self.engines[next(name for name in self.engines if name != GPU)]
