"""Per-iteration choice between Local, Assisted and Cooperative execution on the CPU engine.

Pure (no torch, grpc or clock): the runner reports measured iteration latencies
and failures; the chooser predicts each mode's latency for a batch size from
recent measurements and picks the faster one. A hardware profile can seed it with
predicted latencies per batch bucket (`seed`, from the profile's cost model); a
bucket's first measurement of a mode then replaces that mode's prediction, so the
measurements take over. Without a profile the first iterations of each bucket
measure both modes before comparing. After a failure of the
assist path it backs off (exponentially, in iterations) before trying again (a refusal because the GPU is
busy is not a failure: record_device_busy learns it as a latency), and
it re-probes the slower mode now and then so a change (the GPU getting busy or
free) is noticed.

Cooperative (when the GPU server accepts joins, `cooperative_configured`): the iteration's dense
rows ride in the GPU engine's own step. The chooser then
keeps three latencies per bucket; `always` (the gated policy) means cooperative; a cooperative
request that the server ran staged is recorded as ASSISTED too (record_cooperative), so both are
learnt and the cooperative estimate is the outcome of asking to join, whatever ran.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field


class ExecutionMode(str, enum.Enum):
    LOCAL = "local"  # every stage on the CPU
    ASSISTED = "assisted"  # dense stages on gpu_service, attention on the CPU
    COOPERATIVE = "cooperative"  # dense rows joined into the GPU engine's own step, attention on the CPU


class AssistSetting(str, enum.Enum):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


EMA_WEIGHT = 0.2  # weight of a new measurement in the running latency estimate
REPROBE_EVERY = 64  # iterations between probes of the mode not currently preferred
BACKOFF_MIN_ITERATIONS = 8
BACKOFF_MAX_ITERATIONS = 512
MIN_DEVICE_WAIT_MS = 5
DEFAULT_DEVICE_WAIT_MS = 50


def batch_bucket(batch_size: int) -> int:
    """Batch sizes are grouped by powers of two: 1, 2, 4, 8, ..."""
    bucket = 1
    while bucket < batch_size:
        bucket *= 2
    return bucket


def batch_buckets(max_batch_size: int) -> list[int]:
    """Every bucket a batch of 1..max_batch_size falls in: 1, 2, 4, ..., batch_bucket(max)."""
    buckets = [1]
    while buckets[-1] < max_batch_size:
        buckets.append(buckets[-1] * 2)
    return buckets


def predicted_latencies(local_ms: Callable[[int], float], assisted_ms: Callable[[int], float] | None,
                        max_batch_size: int,
                        cooperative_ms: Callable[[int], float] | None = None) -> dict[tuple[ExecutionMode, int], float]:
    """Seed values for ModeChooser.seed: each mode's predicted latency at each bucket's batch
    size (e.g. from dualpace.profile.cost_model.CostModel.cpu_local_ms / cpu_assisted_ms)."""
    predicted = {}
    for bucket in batch_buckets(max_batch_size):
        predicted[(ExecutionMode.LOCAL, bucket)] = float(local_ms(bucket))
        if assisted_ms is not None:
            predicted[(ExecutionMode.ASSISTED, bucket)] = float(assisted_ms(bucket))
        if cooperative_ms is not None:
            predicted[(ExecutionMode.COOPERATIVE, bucket)] = float(cooperative_ms(bucket))
    return predicted


@dataclass
class ModeChooser:
    setting: AssistSetting
    assist_configured: bool  # a gpu_service address was given
    latency_ms: dict[tuple[ExecutionMode, int], float] = field(default_factory=dict)  # measured (EMA)
    predicted_ms: dict[tuple[ExecutionMode, int], float] = field(default_factory=dict)  # from a profile
    num_iterations: int = 0
    backoff_until: int = 0
    backoff_iterations: int = BACKOFF_MIN_ITERATIONS
    cooperative_configured: bool = False  # the GPU server accepts joins into its engine's step

    def _device_modes(self) -> list[ExecutionMode]:
        """Cooperative first: on equal estimates it reads the weights once for both engines."""
        return ([ExecutionMode.COOPERATIVE] if self.cooperative_configured else []) + [ExecutionMode.ASSISTED]

    def choose(self, batch_size: int, decode_only: bool) -> ExecutionMode:
        """Assisted needs a decode-only batch (one token per sequence) and a gpu_service."""
        self.num_iterations += 1
        if not decode_only or not self.assist_configured or self.setting == AssistSetting.NEVER:
            return ExecutionMode.LOCAL
        if self.num_iterations < self.backoff_until:
            return ExecutionMode.LOCAL
        if self.setting == AssistSetting.ALWAYS:
            return self._device_modes()[0]  # cooperative where the server can join
        bucket = batch_bucket(batch_size)
        modes = [ExecutionMode.LOCAL, *self._device_modes()]
        estimates = {}
        for mode in modes:  # measure each mode once per bucket before comparing
            estimate = self.estimate_ms(mode, bucket)
            if estimate is None:
                return mode
            estimates[mode] = estimate
        faster = min(modes, key=lambda mode: estimates[mode])  # ties: the earlier (local first)
        if self.num_iterations % REPROBE_EVERY == 0:
            others = [mode for mode in modes if mode != faster]
            return others[(self.num_iterations // REPROBE_EVERY) % len(others)]
        return faster

    def seed(self, predicted_ms: dict[tuple[ExecutionMode, int], float]) -> None:
        """Start from predicted latencies per (mode, bucket); measurements replace them."""
        self.predicted_ms.update(predicted_ms)

    def estimate_ms(self, mode: ExecutionMode, bucket: int) -> float | None:
        """The measured latency of `mode` at `bucket`, else the profile's prediction, else None."""
        measured = self.latency_ms.get((mode, bucket))
        return measured if measured is not None else self.predicted_ms.get((mode, bucket))

    def max_device_wait_ms(self, batch_size: int) -> int:
        """How long an assisted iteration may wait for a busy GPU before it is better run
        locally: about the local iteration's own latency (0 = no bound, for `always`)."""
        if self.setting != AssistSetting.AUTO:
            return 0
        local = self.estimate_ms(ExecutionMode.LOCAL, batch_bucket(batch_size))
        return max(MIN_DEVICE_WAIT_MS, int(local)) if local is not None else DEFAULT_DEVICE_WAIT_MS

    def max_join_wait_ms(self, batch_size: int) -> float:
        """How long a cooperative iteration may wait for the GPU engine's next step (the begin's
        max_join_wait_us): its slack, the local estimate minus the cooperative one, so it never
        waits where a local iteration would be faster; 0 (wait up to the stage timeout) for
        `always`, the gated policy."""
        if self.setting != AssistSetting.AUTO:
            return 0.0
        bucket = batch_bucket(batch_size)
        local = self.estimate_ms(ExecutionMode.LOCAL, bucket)
        cooperative = self.estimate_ms(ExecutionMode.COOPERATIVE, bucket)
        if local is None or cooperative is None:
            return float(MIN_DEVICE_WAIT_MS)
        return max(0.0, local - cooperative)

    def record(self, mode: ExecutionMode, batch_size: int, latency_ms: float) -> None:
        key = (mode, batch_bucket(batch_size))
        previous = self.latency_ms.get(key)
        self.latency_ms[key] = latency_ms if previous is None else (1 - EMA_WEIGHT) * previous + EMA_WEIGHT * latency_ms
        if mode != ExecutionMode.LOCAL:
            self.backoff_iterations = BACKOFF_MIN_ITERATIONS

    def record_cooperative(self, batch_size: int, latency_ms: float, ran_staged: bool) -> None:
        """A cooperative request's latency: the outcome of asking to join; when the server ran it
        staged (not taken in time, or the step's planner declined) also a staged assisted one."""
        self.record(ExecutionMode.COOPERATIVE, batch_size, latency_ms)
        if ran_staged:
            self.record(ExecutionMode.ASSISTED, batch_size, latency_ms)

    def record_device_busy(self, mode: ExecutionMode, batch_size: int, latency_ms: float) -> None:
        """The GPU server refused an Assisted or Cooperative iteration because its device wait ran
        past the budget (RESOURCE_EXHAUSTED: the GPU is busy, the path works) and it was redone
        locally; latency_ms is the whole iteration, refusal and local redo. That is the outcome of
        choosing `mode` on a busy GPU, so it is learnt as `mode`'s latency (a cooperative ask that
        was refused ran staged: learnt as assisted too) and the chooser compares it with Local as
        it does any measurement. No backoff: backing off to Local whatever its estimate ran batches
        whose Local iteration is several times slower than the device's (and past the ITL target)
        locally for 8-128 iterations after a single refusal (simulated A10G)."""
        if mode not in (ExecutionMode.ASSISTED, ExecutionMode.COOPERATIVE):
            raise ValueError(f"only a device mode can be refused, got {mode!r}")
        if mode is ExecutionMode.COOPERATIVE:
            self.record_cooperative(batch_size, latency_ms, ran_staged=True)
        else:
            self.record(mode, batch_size, latency_ms)

    def record_assist_failure(self) -> None:
        """The assist path failed mid-iteration: run locally for a while, longer each time."""
        self.backoff_until = self.num_iterations + self.backoff_iterations
        self.backoff_iterations = min(2 * self.backoff_iterations, BACKOFF_MAX_ITERATIONS)
