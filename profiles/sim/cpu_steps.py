"""The simulated CPU engine's iterations, Local or Assisted, chosen by the real ModeChooser
(dualpace.policy.mode_choice) as cpu_service's runner chooses them: seeded from the profile's
cost model like `dualpace-cpu --profile`, then fed each simulated iteration's latency as the
runner feeds it measured ones (an Assisted latency includes its waits for the shared GPU).

An Assisted iteration that would wait for the GPU longer than the chooser's bound
(`max_device_wait_ms`, as the client sends it) is refused by gpu_service and redone locally
after that wait, and the chooser learns the whole iteration as that mode's latency
(`record_device_busy`), as cpu_service does on RESOURCE_EXHAUSTED. With
per-layer sharing ("layer", "cooperative": a staged iteration) each stage's wait for the GPU
engine's next layer boundary is charged to that same bound, as gpu_service charges it
(DenseAssistSession._device_stage): a stage that would wait past what is left of it is refused
when it runs out, and the iteration is redone locally from there (the stages already run stay
in the GPU's step), learnt the same way.

A part of profiles.sim.simulator.Simulator (it uses the simulator's clock, device and event
queue); kept apart so each file reads on its own.
"""

from __future__ import annotations

from dualpace.engine.scheduler import StepPlan
from dualpace.policy.mode_choice import AssistSetting, ExecutionMode, ModeChooser
from dualpace.policy.policies import Policy, traits
from dualpace.profile.cost_model import CostModel, DecodeBatch, predicted_mode_latencies
from profiles.sim.config import GPU

SEED_CONTEXT_TOKENS = 512
_EPS_MS = 1e-9  # cpu_service's --profile-context-tokens default


def make_chooser(cost: CostModel, policy: Policy, max_batch_size: int, cooperative: bool = False) -> ModeChooser:
    """The CPU engine's chooser: `always` under the gated policy (cpu_service --policy gated),
    else `auto`; assist is configured when the cost model has it; cooperative (hold
    "cooperative") when the GPU side joins iterations into its steps."""
    setting = AssistSetting.ALWAYS if traits(policy).cpu_decodes_inside_gpu_steps else AssistSetting.AUTO
    cooperative = cooperative and cost.assist_available
    chooser = ModeChooser(setting, assist_configured=cost.assist_available, cooperative_configured=cooperative)
    chooser.seed(predicted_mode_latencies(cost, max_batch_size, SEED_CONTEXT_TOKENS, cost.assist_available, cooperative))
    return chooser


class CpuSteps:
    """Simulator methods that start the CPU engine's iterations (mixed into Simulator)."""

    def _try_start_cpu(self, cpu) -> None:
        if cpu.busy or not cpu.scheduler.has_work:
            return
        gated = traits(self.config.policy).cpu_decodes_inside_gpu_steps
        device = self.device
        held = gated and self.config.assist_device_hold == "layer"  # gpu_service cannot join: it holds
        if held and device.wait_ms(self.now_ms) > 0:  # the gate: wait for the GPU iteration's end
            self._wake(device.free_at_ms())
            return
        plan = cpu.scheduler.schedule()
        if plan.is_empty:
            return
        prefill_tokens, contexts, sampled = self._plan_shape(plan)
        decode = DecodeBatch.of(contexts)
        cost = self.cost.cpu_iteration(decode, prefill_tokens, sampled)
        batch = len(plan.sequences)
        decode_only = all(len(seq.token_ids) == 1 and seq.sample for seq in plan.sequences)  # as the runner asks
        mode = self.chooser.choose(batch, decode_only)
        local_start_ms = self.now_ms
        if mode is ExecutionMode.COOPERATIVE and cost.assisted_ms is not None:
            self.num_cooperative_choices += 1
            if gated or self._next_gpu_step_within_a_layer():
                self._join_next_gpu_iteration(cpu, plan, decode, cost.assisted_ms)  # rows in the GPU's step
            else:
                cpu.staged_batch = batch  # declined as late: the server runs it staged
                self.cpu_joining, self.cpu_ran_staged = True, True
                self.num_joins_declined_to_staged += 1
                self._start_staged(cpu, plan, self._assist_device_ms(decode.batch), cost.assisted_ms)
            return
        if mode is ExecutionMode.ASSISTED and cost.assisted_ms is not None:
            if not held:
                cpu.staged_batch = batch  # its latency is recorded when it ends
                self.cpu_joining = False
                self._start_staged(cpu, plan, self._assist_device_ms(decode.batch), cost.assisted_ms)
                return
            wait = device.wait_ms(self.now_ms)
            bound_ms = self.chooser.max_device_wait_ms(batch)
            if bound_ms and wait > bound_ms:
                # refused after bound_ms (the GPU is busy), redone locally: learnt as a latency
                self.chooser.record_device_busy(ExecutionMode.ASSISTED, batch, bound_ms + cost.local_ms)
                local_start_ms = self.now_ms + bound_ms
            else:
                device.book_block(self.now_ms, cost.assisted_ms)
                cpu.num_assisted += 1
                self.chooser.record(ExecutionMode.ASSISTED, batch, wait + cost.assisted_ms)
                self._start(cpu, plan, self.now_ms + wait + cost.assisted_ms + self.config.engine_overhead_ms)
                return
        cpu.num_local += 1
        self.chooser.record(ExecutionMode.LOCAL, batch, cost.local_ms)
        self._start(cpu, plan, local_start_ms + cost.local_ms + self.config.engine_overhead_ms)

    def _next_gpu_step_within_a_layer(self) -> bool:
        """The GPU engine's next step begins within one of its layers: it has work and the device
        is free, or its running step is in its last layer (gpu_service's JoinDesk declines an
        offer while a step has more left)."""
        gpu = self.engines[GPU]
        if not gpu.busy:
            return gpu.scheduler.has_work
        return self.device.wait_ms(self.now_ms) <= self.device.engine_layer_ms() + _EPS_MS

    def _staged_done(self, cpu) -> None:
        """A staged Assisted iteration ended: its latency, device waits included, is measured."""
        if cpu.staged_batch is not None:
            latency_ms = self.now_ms - cpu.started_ms - self.config.engine_overhead_ms
            if self.cpu_joining:
                self.chooser.record_cooperative(cpu.staged_batch, latency_ms, self.cpu_ran_staged)
            else:
                self.chooser.record(ExecutionMode.ASSISTED, cpu.staged_batch, latency_ms)
            cpu.staged_batch = None

    def _start_staged(self, cpu, plan: StepPlan, device_ms: float, assisted_ms: float) -> None:
        """An assisted iteration as num_layers + 1 device stages (begin, one per layer's
        attention output) with the CPU's part (attention, round trips) between them."""
        cpu.busy = True
        cpu.plan = plan
        cpu.started_ms = self.now_ms
        cpu.num_iterations += 1
        cpu.num_assisted += 1
        num_stages = self.num_layers + 1
        stage_ms = device_ms / num_stages
        between_ms = max(0.0, assisted_ms - device_ms) / self.num_layers
        self._next_stage(cpu, num_stages, stage_ms, between_ms, self._stage_budget_ms(len(plan.sequences)))

    def _stage_budget_ms(self, batch: int) -> float | None:
        """The device wait a staged iteration may spend in all (the begin's max_device_wait_ms; None: no bound)."""
        return float(self.chooser.max_device_wait_ms(batch)) or None

    def _next_stage(self, cpu, stages_left: int, stage_ms: float, between_ms: float,
                    budget_ms: float | None = None) -> None:
        if budget_ms is not None:
            wait_ms = self.device.stage_start_ms(self.now_ms) - self.now_ms
            if wait_ms > budget_ms:
                self._push(self.now_ms + budget_ms, "call", lambda: self._staged_refused(cpu))
                return
            budget_ms -= wait_ms
        end_ms, gpu_end_ms = self.device.run_stage(self.now_ms, stage_ms)
        if gpu_end_ms is not None:
            gpu = self.engines[GPU]
            gpu.done_version += 1
            self._push(gpu_end_ms + self.config.engine_overhead_ms, "done", (GPU, gpu.done_version))
        if stages_left == 1:
            cpu.done_version += 1
            self._push(end_ms + self.config.engine_overhead_ms, "done", (cpu.name, cpu.done_version))
        else:
            self._push(end_ms + between_ms, "call",
                       lambda: self._next_stage(cpu, stages_left - 1, stage_ms, between_ms, budget_ms))

    def _staged_refused(self, cpu) -> None:
        """gpu_service refused a stage (RESOURCE_EXHAUSTED): cpu_service redoes the iteration
        locally, in the same step, and the chooser learns the whole iteration as the mode it chose
        (CpuRunner.run_plan, ModeChooser.record_device_busy)."""
        plan, started_ms = cpu.plan, cpu.started_ms
        prefill_tokens, contexts, sampled = self._plan_shape(plan)
        local_ms = self.cost.cpu_iteration(DecodeBatch.of(contexts), prefill_tokens, sampled).local_ms
        cpu.staged_batch = None  # nothing is recorded as assisted or cooperative when it ends
        cpu.num_assisted -= 1
        cpu.num_local += 1
        cpu.num_iterations -= 1  # the same step
        self.num_staged_refusals += 1
        chosen = ExecutionMode.COOPERATIVE if self.cpu_joining else ExecutionMode.ASSISTED
        self.chooser.record_device_busy(chosen, len(plan.sequences), self.now_ms - started_ms + local_ms)
        self.chooser.record(ExecutionMode.LOCAL, len(plan.sequences), local_ms)
        self._start(cpu, plan, self.now_ms + local_ms + self.config.engine_overhead_ms)
        cpu.started_ms = started_ms
