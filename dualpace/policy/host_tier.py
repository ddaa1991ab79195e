"""Where a request goes when its prefix lives in the host tier. Pure.

The GPU engine offers the cached blocks of its finished requests to the CPU engine's pool
(dualpace.engine.transfer.host_tier); once the GPU engine has evicted them, the CPU engine is the only
one holding that history. A new request (the next turn of the conversation) then has three
ways to go:

- *recompute*: the usual placement, which prefills its whole prompt again on the GPU engine;
- *continue on the CPU engine*: decode there and prefill only the tokens past its cached
  prefix, with no copy and no GPU work at all;
- *copy back*: the CPU engine sends the cached prefix to the GPU engine's prefix cache
  (CopyPrefix, a cache-only KV transfer that skips blocks the GPU engine holds), then the
  request runs on the GPU engine, which prefills only the suffix.

`place_host_prefix` considers the host tier only when the policy is dualpace (gated and gpu-only
stand for systems without such a tier) and a CPU engine caches at least `min_gain_tokens` more
of the prompt than any GPU engine. Continuing needs that CPU engine to take the request by the
ordinary rules (healthy, ITL target, cpu_max_running, KV room) and at most `max_suffix_tokens`
left to prefill; copying back needs a healthy GPU engine with KV room. Between the two:

- with a profile's cost model (AdmissionConfig.predictor offering the prefill figures), the
  cheaper completion estimate wins, where continuing costs the CPU prefill of the suffix plus
  the expected output tokens at the CPU engine's predicted ITL, and copying back costs the
  KV transfer of the prefix (the profile's kv_transfer figures) plus the GPU prefill of the
  suffix plus the output at the GPU engine's ITL; copying back is taken only when its transfer
  plus suffix prefill is below recomputing the whole prompt on the GPU engine;
- without one: continue when allowed (what was measured to pay on CPU-only hosts), else copy back (a
  transfer of KV costs a small share of recomputing it on any hardware the profiles cover).

Otherwise None, and the request goes through `admit` as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from dualpace.policy.admission import (
    AdmissionConfig,
    _can_place,
    _ceil_share,
    _free_blocks_if_room,
    _within_itl_target,
)
from dualpace.policy.policies import traits
from dualpace.policy.views import EngineView, RoutedRequest, count_held, held_contexts


@dataclass(frozen=True)
class HostTierRule:
    enabled: bool = True
    min_gain_tokens: int = 64  # cached on the CPU engine beyond the best GPU engine's cached prefix
    max_suffix_tokens: int = 256  # prompt tokens past the cached prefix the CPU engine prefills itself
    copy_back: bool = True  # may copy the prefix back to a GPU engine

    def __post_init__(self) -> None:
        if self.min_gain_tokens < 1 or self.max_suffix_tokens < 1:
            raise ValueError(f"min_gain_tokens and max_suffix_tokens must be >= 1, got {self}")


class HostTierChoice(str, Enum):
    CONTINUE_ON_CPU = "continue-on-cpu"
    COPY_TO_GPU = "copy-to-gpu"


@dataclass(frozen=True)
class HostTierPlacement:
    choice: HostTierChoice
    cpu_engine: str  # holds the prefix; runs the request when continuing
    gpu_engine: str | None  # copy back: receives the prefix and runs the request
    num_cached_tokens: int  # of the prompt, on cpu_engine


@runtime_checkable
class PrefixCosts(Protocol):
    """The figures the choice needs from a profile (dualpace.profile.cost_model.CostModel)."""

    def gpu_prefill_ms(self, num_tokens: int) -> float: ...
    def cpu_prefill_ms(self, num_tokens: int) -> float: ...
    def kv_transfer_ms(self, num_tokens: int) -> float: ...
    def itl_ms(self, kind: str, context_tokens: Sequence[int]) -> float: ...


def place_host_prefix(num_prompt_tokens: int, max_tokens: int, engines: Mapping[str, EngineView],
                      placed: Sequence[RoutedRequest], config: AdmissionConfig,
                      cached_prefix_tokens: Mapping[str, int], rule: HostTierRule) -> HostTierPlacement | None:
    """Continue on a CPU engine, copy its cached prefix back to a GPU engine, or None (admit as usual)."""
    if not rule.enabled or not traits(config.policy).continues_on_host_tier:
        return None
    best_gpu = max((cached_prefix_tokens.get(e.name, 0) for e in engines.values() if e.kind == "gpu"), default=0)
    holders = [e for e in sorted(engines.values(), key=lambda e: e.name)
               if e.kind == "cpu" and _can_place(e) and cached_prefix_tokens.get(e.name, 0) - best_gpu >= rule.min_gain_tokens]
    if not holders:
        return None
    expected_tokens = num_prompt_tokens + _ceil_share(max_tokens, config.expected_output_fraction)
    holder = max(holders, key=lambda e: cached_prefix_tokens[e.name])  # the first of the longest
    cached = cached_prefix_tokens[holder.name]
    can_continue = [e.name for e in holders if cached_prefix_tokens[e.name] == cached
                    and _cpu_can_continue(e, num_prompt_tokens, cached, expected_tokens, placed, config, rule)]
    gpu = _gpu_for_copy(engines, expected_tokens, placed, config) if rule.copy_back else None
    if can_continue and gpu is not None and isinstance(config.predictor, PrefixCosts):
        if _copy_is_cheaper(config.predictor, num_prompt_tokens, cached, expected_tokens - num_prompt_tokens,
                            engines[can_continue[0]], engines[gpu], placed):
            return HostTierPlacement(HostTierChoice.COPY_TO_GPU, holder.name, gpu, cached)
        return HostTierPlacement(HostTierChoice.CONTINUE_ON_CPU, can_continue[0], None, cached)
    if can_continue:
        return HostTierPlacement(HostTierChoice.CONTINUE_ON_CPU, can_continue[0], None, cached)
    if gpu is not None and (not isinstance(config.predictor, PrefixCosts)
                            or _copy_beats_recompute(config.predictor, num_prompt_tokens, cached)):
        return HostTierPlacement(HostTierChoice.COPY_TO_GPU, holder.name, gpu, cached)
    return None


def continue_on_host_tier(num_prompt_tokens: int, max_tokens: int, engines: Mapping[str, EngineView],
                          placed: Sequence[RoutedRequest], config: AdmissionConfig,
                          cached_prefix_tokens: Mapping[str, int], rule: HostTierRule) -> str | None:
    """The CPU engine to continue this request on from its host-resident prefix, or None."""
    choice = place_host_prefix(num_prompt_tokens, max_tokens, engines, placed, config, cached_prefix_tokens,
                               HostTierRule(rule.enabled, rule.min_gain_tokens, rule.max_suffix_tokens, copy_back=False))
    return None if choice is None else choice.cpu_engine


def _cpu_can_continue(engine: EngineView, num_prompt_tokens: int, num_cached_tokens: int, expected_tokens: int,
                      placed: Sequence[RoutedRequest], config: AdmissionConfig, rule: HostTierRule) -> bool:
    return (num_prompt_tokens - num_cached_tokens <= rule.max_suffix_tokens
            and count_held(engine, placed) < config.cpu_max_running
            and _within_itl_target(engine, config, placed, num_prompt_tokens)
            and _free_blocks_if_room(engine, expected_tokens, 0.0, placed) is not None)


def _gpu_for_copy(engines: Mapping[str, EngineView], expected_tokens: int, placed: Sequence[RoutedRequest],
                  config: AdmissionConfig) -> str | None:
    """The GPU engine with the most free blocks that has room for the request (with the usual reserve)."""
    best: tuple[int, str] | None = None
    for engine in sorted(engines.values(), key=lambda e: e.name):
        if engine.kind != "gpu" or not _can_place(engine):
            continue
        free = _free_blocks_if_room(engine, expected_tokens, config.gpu_kv_reserve_fraction, placed)
        if free is not None and (best is None or free > best[0]):
            best = (free, engine.name)
    return None if best is None else best[1]


def _copy_beats_recompute(costs: PrefixCosts, num_prompt_tokens: int, num_cached_tokens: int) -> bool:
    copy_ms = costs.kv_transfer_ms(num_cached_tokens) + costs.gpu_prefill_ms(num_prompt_tokens - num_cached_tokens)
    return copy_ms < costs.gpu_prefill_ms(num_prompt_tokens)


def _copy_is_cheaper(costs: PrefixCosts, num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int,
                     cpu: EngineView, gpu: EngineView, placed: Sequence[RoutedRequest]) -> bool:
    """Copy back when it beats recomputing and its completion estimate beats continuing on the CPU."""
    if not _copy_beats_recompute(costs, num_prompt_tokens, num_cached_tokens):
        return False
    num_suffix = num_prompt_tokens - num_cached_tokens
    context = num_prompt_tokens + num_output_tokens // 2  # the mean context while it decodes
    cpu_ms = (costs.cpu_prefill_ms(num_suffix)
              + num_output_tokens * costs.itl_ms("cpu", held_contexts(cpu, placed) + [context]))
    copy_ms = (costs.kv_transfer_ms(num_cached_tokens) + costs.gpu_prefill_ms(num_suffix)
               + num_output_tokens * costs.itl_ms("gpu", held_contexts(gpu, placed) + [context]))
    return copy_ms < cpu_ms
