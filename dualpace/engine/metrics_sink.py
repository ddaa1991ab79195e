"""What EngineLoop reports about its work, to whoever counts it.

The loop calls a MetricsSink after steps, commands and events; the engine daemon
passes one that feeds Prometheus (dualpace.serve.engine_loop_metrics), so the
core engine never imports the serving layer. Tests and the simulator pass
nothing and get NoMetrics.
"""

from __future__ import annotations

from typing import Protocol


class MetricsSink(Protocol):
    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        """A request arrived from a client (its latencies start now)."""

    def request_imported(self, request_id: str) -> None:
        """A request arrived by migration (no TTFT or E2E of its own here)."""

    def request_closed(self, request_id: str) -> None:
        """The request's stream is done; forget it."""

    def all_requests_failed(self) -> None:
        """The engine failed; every request it held is gone."""

    def tokens(self, request_id: str, num_tokens: int, now_s: float) -> None:
        """`num_tokens` new tokens of the request were published at `now_s` (perf_counter)."""

    def finished(self, request_id: str, finish_reason: str, now_s: float) -> None:
        """The request finished (`finish_reason` as in FinishReason.value)."""

    def nonfinite_logits(self) -> None:
        """A request was ended because its logits were not finite."""

    def request_orphaned(self) -> None:
        """A request was aborted because no stream re-attached within its orphan lease."""

    def iteration(self, mode: str, seconds: float) -> None:
        """A step that did work took `seconds` of model time in `mode` (gpu, local, assisted)."""

    def state(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int,
              num_preemptions: int) -> None:
        """The scheduler's state now; `num_preemptions` is its running total."""

    def prefix_cache(self, medium: str, num_query_tokens: int, num_hit_tokens: int, num_cached_blocks: int) -> None:
        """The prefix cache's running token totals and its cached blocks now."""


class NoMetrics:
    """A MetricsSink that counts nothing (the default of an EngineLoop)."""

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        pass

    def request_imported(self, request_id: str) -> None:
        pass

    def request_closed(self, request_id: str) -> None:
        pass

    def all_requests_failed(self) -> None:
        pass

    def tokens(self, request_id: str, num_tokens: int, now_s: float) -> None:
        pass

    def finished(self, request_id: str, finish_reason: str, now_s: float) -> None:
        pass

    def nonfinite_logits(self) -> None:
        pass

    def request_orphaned(self) -> None:
        pass

    def iteration(self, mode: str, seconds: float) -> None:
        pass

    def state(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int,
              num_preemptions: int) -> None:
        pass

    def prefix_cache(self, medium: str, num_query_tokens: int, num_hit_tokens: int, num_cached_blocks: int) -> None:
        pass
