"""The prefix cache in the simulator: the engines' own, not a model of it. Pure.

With `SimConfig.prefix_caching` (the default, as on the daemons) each simulated engine's
Scheduler gets a BlockHasher and a KV event log, exactly as dualpace.engine.core builds
them, so a request whose prompt shares full blocks with what an engine still caches is
admitted after that prefix, its prefill plan holds only the rest, and the cost model times
only the rest: simulated TTFT reflects caching (and eviction, under the pool's LRU).
The router side is the real one too: a PrefixIndex fed from the engines' event logs gives
admission its cached-prefix lengths, and the host-tier rule (dualpace.policy.host_tier)
continues a request on the CPU engine where only that engine caches its prefix.

What it does not model: the GPU engine's host-tier offers (blocks a finished GPU request
copies to the CPU engine's pool); the CPU engine's cache holds what hand-offs and its own
requests put there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dualpace.engine.scheduler import Scheduler, SchedulerConfig
from dualpace.kv.events import KvEventLog
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.kv.prefix_index import PrefixIndex

SIM_SALT = "dualpace-sim"  # one model, one weights format: every simulated engine shares it


def make_scheduler(config: SchedulerConfig, num_blocks: int, block_size: int, max_context_tokens: int,
                   kind: str, prefix_caching: bool) -> Scheduler:
    hasher = BlockHasher(block_size, SIM_SALT) if prefix_caching else None
    events = KvEventLog(kind, block_size, max_events=1 << 20) if prefix_caching else None
    return Scheduler(config, num_blocks, block_size, max_context_tokens, frozenset(), hasher, events)


class SimPrefixIndex:
    """The router's prefix index, fed from the simulated engines' event logs (instantly: the
    real router hears them over a stream within milliseconds)."""

    def __init__(self, schedulers: Mapping[str, Scheduler]):
        self.schedulers = dict(schedulers)
        self.index = PrefixIndex()
        self._seen: dict[str, int] = {name: 0 for name in self.schedulers}

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        for name, scheduler in self.schedulers.items():
            if scheduler.prefix_cache is None or scheduler.prefix_cache.events is None:
                continue
            log = scheduler.prefix_cache.events
            events = log.since(self._seen[name])
            if events is None:  # fell behind the log's window: start again from its snapshot
                events = log.snapshot()
            self.index.apply(name, events)
            self._seen[name] = log.last_event_id
        return {name: self.index.cached_prefix_tokens(name, token_ids) for name in self.schedulers}


def prefix_cache_counts(schedulers: Sequence[Scheduler]) -> tuple[int, int]:
    """(prompt tokens looked up, of those found cached) over the engines."""
    return (sum(s.num_prefix_query_tokens for s in schedulers), sum(s.num_prefix_hit_tokens for s in schedulers))
