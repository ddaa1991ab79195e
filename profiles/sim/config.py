"""What a simulation is given (SimConfig) and what it reports (SimResult)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dualpace.engine.scheduler import SchedulerConfig
from dualpace.errors import DualPaceError
from dualpace.policy.admission import GpuAdmission
from dualpace.policy.host_tier import HostTierRule
from dualpace.policy.policies import Policy

GPU, CPU = "gpu0", "cpu0"  # the simulated engines' names

# How an Assisted CPU iteration shares the GPU (profiles/sim/device.py), as the daemons run it:
# "cooperative" where gpu_service accepts joins (shared memory, one host), "layer" where it
# cannot (another host, or gpu_service --assist-join off).
ASSIST_DEVICE_HOLDS = ("cooperative", "layer")


class SimulationError(DualPaceError):
    """The simulation cannot make progress (e.g. a request that fits no engine)."""


@dataclass(frozen=True)
class SimConfig:
    policy: Policy = Policy.DUALPACE
    gpu_scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(max_batch_tokens=2048, max_running=256, max_waiting=1 << 30))
    cpu_scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(max_batch_tokens=512, max_running=128, max_waiting=1 << 30))
    planner_interval_ms: float = 100.0
    # The router sees each engine's KV use and running/waiting counts through WatchLoad
    # snapshots sent every router.engines.WATCH_INTERVAL_MS (100 ms): a view is at most this old.
    # 0: instantaneous views (the simulator before the validation against real runs).
    view_interval_ms: float = 100.0
    # Host time each engine iteration spends outside the model's forward pass, which a
    # profile's tables (ModelRunner.execute and its parts) do not contain: the engine loop's
    # schedule/apply, the executor hop, streaming the new tokens to the router. It delays the
    # iteration's end (and so its tokens) but does not hold the GPU. 0: not modelled.
    engine_overhead_ms: float = 0.0
    itl_target_ms: float | None = None  # admission: an engine whose predicted ITL (one more request) exceeds it takes none
    max_context_tokens: int = 1 << 20
    migration_overhead_ms: float = 10.0
    max_queue: int = 1 << 30  # the router's wait queue (a simulation should not reject by default)
    # How an Assisted CPU iteration holds the GPU:
    # "cooperative" (gpu_service on the same host, joins on): its decode rows join the GPU
    #   engine's next step as remote rows, laid out by dualpace.policy.cooperative_plan.plan_layout
    #   (profiles/sim/cooperative.py). dualpace asks only when that step begins within one GPU
    #   layer (as gpu_service's JoinDesk declines a late offer), else runs staged; gated is NEO as
    #   built (CPU requests advance only inside GPU steps, no held device);
    # "layer" (no joins: gpu_service on another host, or --assist-join off): dualpace's dense
    #   stages take the device at the GPU engine's layer boundaries (staged); gated holds the
    #   device for the whole iteration (gpu_service's held downgrade of a join it cannot take).
    assist_device_hold: str = "cooperative"
    # KV pool sizes in blocks (None: the profile's capacities), e.g. to replay a deployment
    # started with --kv-blocks (bench/compare_policies.py's small GPU pool).
    gpu_kv_blocks: int | None = None
    cpu_kv_blocks: int | None = None
    # How the router counts the GPU engine's KV room (dualpace.policy.admission.GpuAdmission);
    # None: the policy's default (optimistic for gpu-only, reserve for dualpace and gated).
    gpu_admission: GpuAdmission | None = None
    # Each engine's prefix cache, as on the daemons (profiles/sim/prefix.py), and the router's
    # rule for continuing a request on the CPU engine that caches its prefix.
    prefix_caching: bool = True
    host_tier: HostTierRule = field(default_factory=HostTierRule)

    def __post_init__(self) -> None:
        if not (self.engine_overhead_ms >= 0 and self.view_interval_ms >= 0):
            raise ValueError("engine_overhead_ms and view_interval_ms must be >= 0")
        if self.assist_device_hold not in ASSIST_DEVICE_HOLDS:
            raise ValueError(f"assist_device_hold must be one of {', '.join(ASSIST_DEVICE_HOLDS)}, "
                             f"got {self.assist_device_hold!r}")


def deterministic_token(request_index: int, position: int, vocab_size: int) -> int:
    """The fake runner's token: a function of the request and the position only (never EOS:
    the simulated engines have no EOS ids)."""
    return 1 + (request_index * 7919 + position * 104729) % max(1, vocab_size - 1)


@dataclass(frozen=True)
class SimResult:
    policy: str
    rate: float
    num_requests: int
    requests_completed: int
    requests_rejected: int
    duration_s: float
    throughput_tokens_per_s: float
    requests_per_s: float
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    p50_itl_ms: float | None
    p99_itl_ms: float | None
    mean_itl_ms: float | None
    num_generated_tokens: int
    num_handoffs: int
    num_migrations: int
    num_moves_without_kv: int
    num_preemptions: int
    gpu_iterations: int
    cpu_iterations: int
    cpu_local_iterations: int
    cpu_assisted_iterations: int
    requests_touching_cpu: int
    gpu_busy_fraction: float
    cpu_busy_fraction: float
    prefix_cache_hit_rate: float | None = None  # prompt tokens found cached / looked up (None: caching off)
    prefill_tokens_saved: int = 0  # prompt tokens whose KV came from a prefix cache instead of a prefill
    # Cooperative execution (hold "cooperative"): how the CPU iterations that asked to join ran.
    num_cooperative_choices: int = 0  # CPU iterations the chooser sent as cooperative
    num_joined_iterations: int = 0  # of those, rows that rode in a GPU step (JOINED or SPLIT layouts)
    num_joined_layouts: int = 0  # JOINED: S0 empty, one weight read per layer for both engines
    num_split_layouts: int = 0  # SPLIT: asymmetric pipelining
    num_joins_declined_to_staged: int = 0  # not taken in time, or the planner declined: ran staged
    mean_join_wait_ms: float | None = None  # the CPU's wait from its ask to the shared layer
    num_layers_shared: int = 0  # layers in which remote rows shared the GPU's weight read, over all joins
    num_gpu_engine_tokens: int = 0  # tokens emitted by the GPU engine (compare: the load generator's tokens_by_engine)

    def as_dict(self) -> dict:
        out = {}
        for name, value in self.__dict__.items():
            out[name] = round(value, 3) if isinstance(value, float) and math.isfinite(value) else value
        return out
