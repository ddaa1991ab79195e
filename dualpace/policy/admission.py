"""Admission: where a new request goes — the GPU engine, the CPU engine, the router's
bounded wait queue, or nowhere. Pure: views in, a decision out.

Without a profile, capacity rules decide (KV room, a cap on CPU requests, the engines'
measured p50 ITL against the target). With a profile (`AdmissionConfig.predictor`, a
cost model) and an ITL target, an engine takes the request only if its *predicted* ITL
with one more request of this prompt length stays within the target."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

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

__all__ = ["AdmissionConfig", "GpuAdmission", "Placement", "admit", "blocks_for", "predicted_itl_with_one_more_ms"]

# Guards ceil() against float products such as 300 * 0.1 == 30.000000000000004.
_EPS = 1e-9


class GpuAdmission(str, Enum):
    """How a GPU engine's KV room is counted when placing a request.

    RESERVE: every request placed there counts at its final size (prompt + max_tokens), so
    the engine never runs out of KV and never preempts; a request that does not fit goes to
    the CPU engine (dualpace, gated) or waits. OPTIMISTIC (vLLM V1): the KV allocated now
    (the snapshot, or the placed requests' current footprint) plus a small watermark; the
    new request needs room for its prompt only, and when a decode later needs a block the
    engine preempts its newest request by recompute."""

    RESERVE = "reserve"
    OPTIMISTIC = "optimistic"


class Placement(str, Enum):
    GPU = "gpu"
    CPU = "cpu"
    WAIT = "wait"
    REJECT = "reject"


@dataclass(frozen=True)
class AdmissionConfig:
    policy: Policy = Policy.DUALPACE
    gpu_kv_reserve_fraction: float = 0.1  # keep this share of GPU blocks free for running decodes' growth
    expected_output_fraction: float = 1.0  # share of max_tokens assumed to be generated when sizing KV
    itl_target_ms: float | None = None  # when set: an engine whose recent p50 ITL exceeds it takes no new requests
    cpu_max_running: int = 64  # capacity rule for the CPU engine (a hard cap, also with a profile)
    max_queue: int = 256  # requests the router may hold waiting
    # None: OPTIMISTIC for gpu-only (as vLLM V1 admits), RESERVE for dualpace and gated
    # (the CPU engine takes the overflow instead of the GPU engine preempting).
    gpu_admission: GpuAdmission | None = None
    gpu_kv_watermark_fraction: float = 0.01  # OPTIMISTIC: this share of GPU blocks stays free (vLLM's default 1%)
    # A profile's cost model: with itl_target_ms set, an engine is within target when its
    # predicted ITL with one more request is (instead of its measured p50 ITL).
    predictor: LatencyPredictor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.gpu_admission is not None and not isinstance(self.gpu_admission, GpuAdmission):
            raise ValueError(f"gpu_admission must be one of {', '.join(m.value for m in GpuAdmission)}, "
                             f"got {self.gpu_admission!r}")
        for name in ("gpu_kv_reserve_fraction", "gpu_kv_watermark_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")

    @property
    def resolved_gpu_admission(self) -> GpuAdmission:
        if self.gpu_admission is not None:
            return self.gpu_admission
        return GpuAdmission.RESERVE if traits(self.policy).uses_cpu_engine else GpuAdmission.OPTIMISTIC


def _ceil_share(count: int, fraction: float) -> int:
    return max(0, math.ceil(count * fraction - _EPS))


def _can_place(engine: EngineView) -> bool:
    return engine.healthy and engine.block_size > 0 and engine.kv_blocks_total > 0


def committed_blocks(engine: EngineView, placed: Sequence[RoutedRequest]) -> int:
    """Blocks the requests placed on `engine` will hold when they finish (prompt + max_tokens)."""
    return sum(blocks_for(r.num_prompt_tokens + r.max_tokens, engine.block_size)
               for r in placed if r.engine == engine.name)


def predicted_itl_with_one_more_ms(engine: EngineView, placed: Sequence[RoutedRequest], num_prompt_tokens: int,
                                   predictor: LatencyPredictor) -> float:
    """The engine's predicted ITL once a request of num_prompt_tokens joins what it holds."""
    return predictor.itl_ms(engine.kind, [*held_contexts(engine, placed), num_prompt_tokens])


def _within_itl_target(engine: EngineView, config: AdmissionConfig, placed: Sequence[RoutedRequest],
                       num_prompt_tokens: int) -> bool:
    if config.itl_target_ms is None:
        return True
    if config.predictor is not None:
        predicted = predicted_itl_with_one_more_ms(engine, placed, num_prompt_tokens, config.predictor)
        return predicted <= config.itl_target_ms
    return engine.itl_p50_ms <= config.itl_target_ms


def _free_blocks_if_room(engine: EngineView, num_tokens: int, reserve_fraction: float,
                         placed: Sequence[RoutedRequest], placed_at_final_size: bool = True) -> int | None:
    """Estimated free blocks on `engine` when it has room for num_tokens beyond the reserve, else None.

    The reserve only applies to an engine holding something: an idle engine takes any
    request that fits its whole pool, so a large request cannot wait forever. With
    placed_at_final_size (RESERVE) the requests already placed count at their final size
    (prompt + max_tokens): they will grow into it, and admitting against their current size
    overcommits the GPU under a burst. Without (OPTIMISTIC) they count at their current
    footprint: they grow into free blocks later, and the engine preempts when a decode needs one."""
    used = estimated_blocks_used(engine, placed)
    if placed_at_final_size:
        used = max(used, committed_blocks(engine, placed))
    free = engine.kv_blocks_total - used
    reserve = _ceil_share(engine.kv_blocks_total, reserve_fraction) if used > 0 else 0
    if blocks_for(num_tokens, engine.block_size) <= free - reserve:
        return free
    return None


def _gpu_free_blocks_if_room(engine: EngineView, num_prompt_tokens: int, expected_tokens: int,
                             config: AdmissionConfig, placed: Sequence[RoutedRequest]) -> int | None:
    """OPTIMISTIC: room for the prompt beyond the watermark in the KV allocated now (vLLM V1);
    RESERVE: room for the expected lifetime beyond the reserve, placed requests at final size."""
    if config.resolved_gpu_admission is GpuAdmission.OPTIMISTIC:
        return _free_blocks_if_room(engine, num_prompt_tokens, config.gpu_kv_watermark_fraction, placed,
                                    placed_at_final_size=False)
    return _free_blocks_if_room(engine, expected_tokens, config.gpu_kv_reserve_fraction, placed)


def _pick(candidates: list[tuple[int, str]], cached_prefix_tokens: Mapping[str, int]) -> str | None:
    """The engine holding the longest cached prefix of the request, then the most free blocks; ties by name."""
    if not candidates:
        return None
    return min(candidates, key=lambda c: (-cached_prefix_tokens.get(c[1], 0), -c[0], c[1]))[1]


def admit(num_prompt_tokens: int, max_tokens: int, engines: Mapping[str, EngineView],
          placed: Sequence[RoutedRequest], num_queued: int,
          config: AdmissionConfig,
          cached_prefix_tokens: Mapping[str, int] | None = None) -> tuple[Placement, str | None]:
    """(placement, engine name or None) for a new request.

    GPU if a healthy gpu engine has KV room, counted as config.resolved_gpu_admission
    says: RESERVE (dualpace, gated by default): room for the prompt plus the expected output
    (prompt + ceil(max_tokens * expected_output_fraction) tokens) beyond the reserve, the
    placed requests at their final size; OPTIMISTIC (gpu-only by default, as vLLM V1): room
    for the prompt beyond the watermark in the KV allocated now; and,
    with an ITL target, its ITL is within it; else, unless the policy is gpu-only, CPU
    if a healthy cpu engine has that KV room, fewer than cpu_max_running requests and an
    ITL within target; else WAIT while num_queued < max_queue; else REJECT. The ITL
    checked is the engine's measured p50, or with a predictor (a profile's cost model)
    the predicted ITL with this request added (held requests at their current context,
    this one at its prompt length).

    REJECT also when no engine the policy may use is healthy (the service answers
    UNAVAILABLE) and when prompt + max_tokens exceeds every usable engine's whole pool.
    KV used and running counts are the larger of the snapshot and the router's own
    count of `placed` requests on that engine. Several engines of a kind: the one holding
    the longest cached prefix of the request (`cached_prefix_tokens`, from the engines' KV
    events), then the one with the most free blocks (ties by name).
    """
    cached_prefix_tokens = cached_prefix_tokens or {}
    kinds = ("gpu", "cpu") if traits(config.policy).uses_cpu_engine else ("gpu",)
    usable = [e for e in engines.values() if e.kind in kinds]
    if not any(_can_place(e) for e in usable):
        return Placement.REJECT, None

    lifetime_tokens = num_prompt_tokens + max_tokens
    if not any(e.block_size > 0 and blocks_for(lifetime_tokens, e.block_size) <= e.kv_blocks_total
               for e in usable):
        return Placement.REJECT, None

    expected_tokens = num_prompt_tokens + _ceil_share(max_tokens, config.expected_output_fraction)
    ready = sorted((e for e in usable if _can_place(e) and _within_itl_target(e, config, placed, num_prompt_tokens)),
                   key=lambda e: e.name)

    gpu_candidates = []
    for engine in ready:
        if engine.kind != "gpu":
            continue
        free = _gpu_free_blocks_if_room(engine, num_prompt_tokens, expected_tokens, config, placed)
        if free is not None:
            gpu_candidates.append((free, engine.name))
    gpu = _pick(gpu_candidates, cached_prefix_tokens)
    if gpu is not None:
        return Placement.GPU, gpu

    cpu = _pick_cpu(ready, expected_tokens, config, placed, cached_prefix_tokens)
    if cpu is not None:
        return Placement.CPU, cpu

    if num_queued < config.max_queue:
        return Placement.WAIT, None
    return Placement.REJECT, None


def _pick_cpu(ready: Sequence[EngineView], expected_tokens: int, config: AdmissionConfig,
              placed: Sequence[RoutedRequest], cached_prefix_tokens: Mapping[str, int]) -> str | None:
    """A ready CPU engine under cpu_max_running with room for expected_tokens, or None."""
    cpu_candidates = []
    for engine in ready:
        if engine.kind != "cpu" or count_held(engine, placed) >= config.cpu_max_running:
            continue
        free = _free_blocks_if_room(engine, expected_tokens, 0.0, placed)
        if free is not None:
            cpu_candidates.append((free, engine.name))
    return _pick(cpu_candidates, cached_prefix_tokens)


def handoff_source(num_prompt_tokens: int, max_tokens: int, gpu_engines: Sequence[EngineView]) -> str | None:
    """Where a request placed on the CPU engine is prefilled: the first of `gpu_engines`
    (healthy ones, in the router's order) whose whole pool could ever hold the request at its
    final size (prompt + max_tokens - 1 tokens of KV; engines refuse larger ones even for a
    prefill they would hand off). The GPU engine prefills and samples the first token, then
    hands the KV to the CPU engine. None: no GPU engine could, the CPU engine prefills itself."""
    final_tokens = num_prompt_tokens + max_tokens - 1
    return next((engine.name for engine in gpu_engines if engine.could_ever_hold(final_tokens)), None)
