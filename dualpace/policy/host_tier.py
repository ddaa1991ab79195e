"""Continue on the CPU engine when a request's prefix lives in the host tier. Pure.

The GPU engine offers the cached blocks of its finished requests to the CPU engine's pool
(dualpace.engine.host_tier); once the GPU engine has evicted them, the CPU engine is the only
one holding that history. A new request (the next turn of the conversation) then has two
ways to go: the usual placement, which prefills its whole prompt again on the GPU engine,
or the CPU engine, which decodes it there and prefills only the tokens past its cached
prefix, with no copy and no GPU work at all. This rule takes the CPU engine when

- the policy is dualpace (gated and gpu-only stand for systems that have no such tier);
- a CPU engine caches at least `min_gain_tokens` more of the prompt than any GPU engine;
- what is left to prefill there is at most `max_suffix_tokens` (a CPU prefill is slow: a
  long new message is better prefilled on the GPU, whose engine then recomputes the prefix);
- that CPU engine could take the request now by the ordinary admission rules: healthy,
  within its ITL target (measured, or predicted with a profile), under cpu_max_running and
  with KV room for the prompt and expected output.

Otherwise None, and the request goes through `admit` as before. Copying the prefix back to
the GPU engine instead is the other option the issue names; it is not built (docs/prefix_cache.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dualpace.policy.admission import (
    AdmissionConfig,
    _can_place,
    _ceil_share,
    _free_blocks_if_room,
    _within_itl_target,
)
from dualpace.policy.views import EngineView, Policy, RoutedRequest, count_held


@dataclass(frozen=True)
class HostTierRule:
    enabled: bool = True
    min_gain_tokens: int = 64  # cached on the CPU engine beyond the best GPU engine's cached prefix
    max_suffix_tokens: int = 256  # prompt tokens past the cached prefix the CPU engine prefills itself

    def __post_init__(self) -> None:
        if self.min_gain_tokens < 1 or self.max_suffix_tokens < 1:
            raise ValueError(f"min_gain_tokens and max_suffix_tokens must be >= 1, got {self}")


def continue_on_host_tier(num_prompt_tokens: int, max_tokens: int, engines: Mapping[str, EngineView],
                          placed: Sequence[RoutedRequest], config: AdmissionConfig,
                          cached_prefix_tokens: Mapping[str, int], rule: HostTierRule) -> str | None:
    """The CPU engine to continue this request on from its host-resident prefix, or None."""
    if not rule.enabled or config.policy is not Policy.DUALPACE:
        return None
    best_gpu = max((cached_prefix_tokens.get(e.name, 0) for e in engines.values() if e.kind == "gpu"), default=0)
    expected_tokens = num_prompt_tokens + _ceil_share(max_tokens, config.expected_output_fraction)
    best: tuple[int, str] | None = None
    for engine in sorted(engines.values(), key=lambda e: e.name):
        cached = cached_prefix_tokens.get(engine.name, 0)
        if (engine.kind != "cpu" or cached - best_gpu < rule.min_gain_tokens
                or num_prompt_tokens - cached > rule.max_suffix_tokens):
            continue
        if not _can_place(engine) or count_held(engine, placed) >= config.cpu_max_running:
            continue
        if not _within_itl_target(engine, config, placed, num_prompt_tokens):
            continue
        if _free_blocks_if_room(engine, expected_tokens, 0.0, placed) is None:
            continue
        if best is None or cached > best[0]:
            best = (cached, engine.name)
    return None if best is None else best[1]
