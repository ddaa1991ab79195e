"""Cooperative execution (assist hold "cooperative"): an Assisted CPU iteration's dense rows join
the GPU engine's next iteration instead of a separate pass on the device.

The GPU engine's iteration then computes, layer by layer, the dense work of its own rows and
of the CPU's rows with one read of the layer's weights; the CPU computes its rows' attention
over host KV while the GPU works on its own rows (NEO's asymmetric pipelining). A layer ends
when both halves are done, so the joined iteration takes, per layer,
max(GPU layer + the CPU rows' marginal dense time, the CPU's attention and round trip per
layer), and neither engine waits on the other by more than that one layer's difference.
A joined CPU iteration starts with the GPU's next iteration (layer l of both must meet in
the same GEMM); when the GPU engine has nothing to run, the CPU's rows go alone, stage by
stage, as with hold "layer".

Under the dualpace policy the CPU engine keeps its own clock: it joins only when the GPU's
next iteration begins within one GPU layer (the device is free, or the running iteration is in
its last layer); otherwise its dense stages go at the GPU's layer boundaries as with hold
"layer", so it never waits on the GPU for more than a layer. ModeChooser sees the latencies
and runs locally when that is faster. Under the gated policy (NEO as designed) every CPU iteration joins: CPU
requests advance only inside GPU iterations, but the GPU is not held through the CPU's attention.

A part of profiles.sim.simulator.Simulator (mixed in, like CpuSteps). Pure arithmetic on the
cost model's tables: the marginal dense time of the CPU's rows is the GPU decode table's
difference at the smallest context (its attention part is negligible there).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpace.engine.scheduler import StepPlan
from dualpace.profile.cost_model import DecodeBatch
from profiles.sim.config import GPU


@dataclass
class PendingJoin:
    """An Assisted CPU iteration waiting for the GPU engine's next iteration."""

    batch: int  # the CPU's decode rows
    device_ms: float  # its dense work alone on the device (a separate pass)
    cpu_side_ms: float  # its attention and round trips, over all layers


class Cooperative:
    """Simulator methods for joined iterations (mixed into Simulator)."""

    pending_join: PendingJoin | None = None
    num_joined_iterations = 0  # GPU iterations that carried a CPU iteration's rows

    def _join_next_gpu_iteration(self, cpu, plan: StepPlan, batch: int, assisted_ms: float) -> None:
        device_ms = self._assist_device_ms(batch)
        cpu.busy = True
        cpu.plan = plan
        cpu.started_ms = self.now_ms
        cpu.num_iterations += 1
        cpu.num_assisted += 1
        cpu.staged_batch = batch  # its latency, wait included, is recorded when it ends
        self.pending_join = PendingJoin(batch, device_ms, max(0.0, assisted_ms - device_ms))

    def _next_gpu_iteration_within_a_layer(self) -> bool:
        gpu = self.engines[GPU]
        if not gpu.busy:
            return gpu.scheduler.has_work  # it starts now (with nothing to run, the stages go alone)
        return self.device.wait_ms(self.now_ms) <= self.device.engine_layer_ms()

    def _joined_iteration_ms(self, gpu_ms: float, prefill_tokens: int, contexts: list[int]) -> float:
        """The GPU iteration's length with the pending CPU rows joined into its GEMMs."""
        join = self.pending_join
        with_rows = self.cost.gpu_iteration_ms(prefill_tokens, DecodeBatch.of(contexts + [self._first_context] * join.batch))
        marginal_ms = max(0.0, with_rows - gpu_ms)
        return max(gpu_ms + marginal_ms, join.cpu_side_ms)

    def _start_joined(self, gpu, plan: StepPlan, duration_ms: float) -> None:
        """Both engines' iterations start now and end together."""
        cpu = self.engines[next(name for name in self.engines if name != GPU)]
        self.pending_join = None
        self.num_joined_iterations += 1
        end_ms = self.device.start_engine(self.now_ms, duration_ms)
        self._start(gpu, plan, end_ms + self.config.engine_overhead_ms)
        cpu.done_version += 1
        self._push(end_ms + self.config.engine_overhead_ms, "done", (cpu.name, cpu.done_version))

    def _run_join_alone(self) -> None:
        """The GPU engine has nothing to run: the CPU's rows take the device stage by stage."""
        join, self.pending_join = self.pending_join, None
        cpu = self.engines[next(name for name in self.engines if name != GPU)]
        num_stages = self.num_layers + 1
        self._next_stage(cpu, num_stages, join.device_ms / num_stages, join.cpu_side_ms / self.num_layers)
