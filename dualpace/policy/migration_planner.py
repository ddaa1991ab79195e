"""Migration planning: which requests move between the GPU and CPU engines this tick
(docs/architecture.md, "Router"). Pure: views in, a list of planned moves out; the service runs them.

With a profile (`MigrationConfig.predictor`, a cost model), the CPU->GPU payoff uses the
predicted ITLs (the CPU engine's current batch, the GPU engine's batch with the request
added) and the predicted KV transfer time instead of the measured p50 ITLs and the
configured bandwidth; with `cpu_itl_target_ms` as well, no request moves to a CPU engine
whose predicted ITL with it would exceed the target."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dualpace.policy.policies import Policy, traits
from dualpace.policy.views import (
    EngineView,
    LatencyPredictor,
    RoutedRequest,
    blocks_for,
    count_held,
    estimated_blocks_used,
    held_contexts,
)

__all__ = ["MigrationConfig", "PlannedMigration", "plan_migrations", "transfer_ms"]

# Without a profile, KV transfer is priced at the slowest gRPC (loopback) migration measured in
# the stored local profiles, profiles/local/smollm2-135m-bf16-amd-epyc-2c-t1-cpu*.json (their
# `kv_transfer` fits: 0.74-1.02 GB/s, 11-24 ms fixed per request, a 2-core AMD EPYC): the lowest
# rate and the highest fixed cost, so a move's payoff is not overestimated on a slow host.
# tests/policy/test_migration_planner.py keeps these in step with those files.
MEASURED_KV_TRANSFER_BYTES_PER_S = 741e6
MEASURED_KV_TRANSFER_FIXED_MS = 24.1
MEASURED_KV_TRANSFER_PROFILES = "profiles/local/smollm2-135m-bf16-amd-epyc-2c-t1-cpu*.json"

REASON_GPU_KV_PRESSURE = "gpu_kv_pressure"
REASON_GPU_HEADROOM = "gpu_headroom"


@dataclass(frozen=True)
class MigrationConfig:
    gpu_high_watermark: float = 0.9  # GPU KV used fraction above which requests move to the CPU
    gpu_target_watermark: float = 0.75  # ...until the projected fraction is at most this
    gpu_low_watermark: float = 0.5  # GPU KV used fraction below which CPU requests may come back
    kv_transfer_bytes_per_s: float = MEASURED_KV_TRANSFER_BYTES_PER_S  # without a profile (see above)
    kv_transfer_fixed_ms: float = MEASURED_KV_TRANSFER_FIXED_MS
    migration_overhead_ms: float = 10.0
    max_per_tick: int = 4  # migrations started per planning tick
    # Moves one request may make in its life (the hand-off counts): without a bound, GPU
    # pressure and GPU headroom send the same requests back and forth under load.
    max_migrations_per_request: int = 2
    kv_bytes_per_token: int = 0  # set by the service from the model (2 * layers * kv_heads * head_dim * dtype bytes)
    cpu_max_running: int | None = None  # when set: no move to a CPU engine already holding this many requests
    predictor: LatencyPredictor | None = field(default=None, compare=False, repr=False)  # a profile's cost model
    cpu_itl_target_ms: float | None = None  # with a predictor: no move that takes a CPU engine's predicted ITL above it


@dataclass(frozen=True)
class PlannedMigration:
    request_id: str
    source: str
    target: str
    reason: str  # "gpu_kv_pressure" | "gpu_headroom"


def transfer_ms(num_tokens: int, config: MigrationConfig) -> float:
    """Predicted time to move num_tokens tokens of KV: the profile's prediction when there is
    one, else a fixed cost plus bytes / bandwidth from the config."""
    if config.predictor is not None:
        return config.predictor.kv_transfer_ms(num_tokens)
    if config.kv_transfer_bytes_per_s <= 0:
        return float("inf")
    num_bytes = max(0, num_tokens) * config.kv_bytes_per_token
    return config.kv_transfer_fixed_ms + 1000.0 * num_bytes / config.kv_transfer_bytes_per_s


def _movable(request: RoutedRequest, config: MigrationConfig) -> bool:
    return (not request.migrating and request.remaining_tokens > 1
            and request.num_migrations < config.max_migrations_per_request)


def _movable_to_cpu(request: RoutedRequest, config: MigrationConfig) -> bool:
    """A GPU request that has not produced a token yet was never prefilled: moving it would make
    the CPU engine prefill it, which is the GPU's job, so it waits for the GPU instead."""
    return _movable(request, config) and request.num_generated_tokens > 0


def _lifetime_blocks(request: RoutedRequest, engine: EngineView) -> int:
    """Blocks the request needs on a target to run to max_tokens (what admission reserves)."""
    return blocks_for(request.num_tokens + request.remaining_tokens, engine.block_size)


class _Projection:
    """Per-engine KV used (blocks) and held-request counts, updated as moves are planned.

    Starts from the router's estimate (max of snapshot and own count), less the blocks of
    requests already migrating away, plus the lifetime blocks of requests migrating in from
    the other kind — so a migration in flight is not planned again next tick."""

    def __init__(self, engines: dict[str, EngineView], requests: Sequence[RoutedRequest]):
        self.engines = engines
        self.used: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.contexts: dict[str, list[int]] = {}  # per engine: context lengths of what it holds
        for name, engine in engines.items():
            self.contexts[name] = held_contexts(engine, [r for r in requests if not r.migrating])
            leaving = sum(blocks_for(r.num_tokens, engine.block_size)
                          for r in requests if r.engine == name and r.migrating)
            arriving = sum(_lifetime_blocks(r, engine) for r in requests
                           if r.migrating and r.engine in engines and engines[r.engine].kind != engine.kind)
            self.used[name] = max(0, estimated_blocks_used(engine, requests) - leaving) + arriving
            self.held[name] = count_held(engine, requests)

    def fraction(self, name: str, extra_blocks: int = 0) -> float:
        return (self.used[name] + extra_blocks) / self.engines[name].kv_blocks_total

    def free(self, name: str) -> int:
        return self.engines[name].kv_blocks_total - self.used[name]

    def move(self, request: RoutedRequest, source: str, target: str) -> None:
        self.used[source] = max(0, self.used[source] - blocks_for(request.num_tokens, self.engines[source].block_size))
        self.used[target] += _lifetime_blocks(request, self.engines[target])
        self.held[source] = max(0, self.held[source] - 1)
        self.held[target] += 1
        if request.num_tokens in self.contexts[source]:
            self.contexts[source].remove(request.num_tokens)
        self.contexts[target].append(request.num_tokens)


def plan_migrations(requests: Sequence[RoutedRequest], engines: Mapping[str, EngineView],
                    policy: Policy, config: MigrationConfig) -> list[PlannedMigration]:
    """The migrations to start this tick, in order.

    gpu-only: none. Otherwise, for each GPU engine under KV pressure (projected used
    fraction above the high watermark, or waiting requests while above the target
    watermark): move its non-migrating requests to the CPU engine with the most free
    blocks that has room for them to finish, most remaining tokens first, until the
    projected GPU fraction is at most the target. For each GPU engine below the low
    watermark with nothing waiting: bring back CPU requests whose payoff
    remaining_tokens * (cpu.itl_p50_ms - gpu.itl_p50_ms) - transfer_ms(num_tokens)
    - migration_overhead_ms is positive, best payoff first, skipping any that would
    take the GPU above the target watermark. With a predictor the payoff is
    remaining_tokens * (predicted CPU ITL now - predicted GPU ITL with the request)
    - predicted transfer - overhead, and a GPU->CPU move must keep the CPU's predicted
    ITL within cpu_itl_target_ms (when set). Never a request already migrating, one
    with remaining_tokens <= 1, or a move from or to an unhealthy engine; at most
    max_per_tick; ties broken by request_id.
    """
    if not traits(policy).migrates or config.max_per_tick <= 0:
        return []
    live = {name: e for name, e in engines.items()
            if e.healthy and e.kv_blocks_total > 0 and e.block_size > 0 and e.kind in ("gpu", "cpu")}
    gpus = sorted(name for name, e in live.items() if e.kind == "gpu")
    cpus = sorted(name for name, e in live.items() if e.kind == "cpu")
    if not gpus or not cpus:
        return []

    projection = _Projection(live, requests)
    planned: list[PlannedMigration] = []
    planned_ids: set[str] = set()

    def full() -> bool:
        return len(planned) >= config.max_per_tick

    def plan(request: RoutedRequest, target: str, reason: str) -> None:
        projection.move(request, request.engine, target)
        planned.append(PlannedMigration(request.request_id, request.engine, target, reason))
        planned_ids.add(request.request_id)

    # GPU -> CPU under KV pressure.
    for gpu in gpus:
        fraction = projection.fraction(gpu)
        pressured = fraction > config.gpu_high_watermark or (
            live[gpu].num_waiting > 0 and fraction > config.gpu_target_watermark)
        if not pressured:
            continue
        candidates = sorted((r for r in requests if r.engine == gpu and _movable_to_cpu(r, config)
                             and r.request_id not in planned_ids),
                            key=lambda r: (-r.remaining_tokens, r.request_id))
        for request in candidates:
            if full() or projection.fraction(gpu) <= config.gpu_target_watermark:
                break
            if request.request_id in planned_ids:  # a duplicate id in the input
                continue
            targets = [(projection.free(cpu), cpu) for cpu in cpus
                       if _lifetime_blocks(request, live[cpu]) <= projection.free(cpu)
                       and (config.cpu_max_running is None or projection.held[cpu] < config.cpu_max_running)
                       and _cpu_within_target(projection, cpu, request, config)]
            if targets:
                plan(request, min(targets, key=lambda t: (-t[0], t[1]))[1], REASON_GPU_KV_PRESSURE)

    # CPU -> GPU when the GPU has headroom and the move pays for itself.
    for gpu in gpus:
        if full():
            break
        if live[gpu].num_waiting > 0 or projection.fraction(gpu) >= config.gpu_low_watermark:
            continue
        scored = []
        for request in requests:
            if request.engine not in cpus or not _movable(request, config) or request.request_id in planned_ids:
                continue
            payoff_ms = (request.remaining_tokens * _itl_gain_ms(projection, request, gpu, config)
                         - transfer_ms(request.num_tokens, config) - config.migration_overhead_ms)
            if payoff_ms > 0:
                scored.append((-payoff_ms, request.request_id, request))
        scored.sort(key=lambda s: (s[0], s[1]))
        for _, _, request in scored:
            if full():
                break
            if request.request_id in planned_ids:
                continue
            extra = _lifetime_blocks(request, live[gpu])
            if projection.fraction(gpu, extra) <= config.gpu_target_watermark:
                plan(request, gpu, REASON_GPU_HEADROOM)
    return planned


def _itl_gain_ms(projection: _Projection, request: RoutedRequest, gpu: str, config: MigrationConfig) -> float:
    """Per-token latency saved by moving `request` from its CPU engine to `gpu`."""
    cpu = projection.engines[request.engine]
    if config.predictor is None:
        return cpu.itl_p50_ms - projection.engines[gpu].itl_p50_ms
    cpu_itl = config.predictor.itl_ms("cpu", projection.contexts[request.engine])
    gpu_itl = config.predictor.itl_ms("gpu", [*projection.contexts[gpu], request.num_tokens])
    return cpu_itl - gpu_itl


def _cpu_within_target(projection: _Projection, cpu: str, request: RoutedRequest, config: MigrationConfig) -> bool:
    if config.predictor is None or config.cpu_itl_target_ms is None:
        return True
    predicted = config.predictor.itl_ms("cpu", [*projection.contexts[cpu], request.num_tokens])
    return predicted <= config.cpu_itl_target_ms
