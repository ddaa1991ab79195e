"""The MetricsSink an engine daemon gives its EngineLoop: Prometheus families of dualpace.serve.metrics.

Request gauges, KV blocks and preemptions after each step and command; iteration latency by mode;
prompt/generation tokens, TTFT, ITL, E2E, finished requests and requests ended by non-finite logits
from the events the loop dispatches. One RequestClock per request the loop holds.
"""

from __future__ import annotations

from dualpace.serve.metrics import EngineMetrics, RequestClock


class PrometheusLoopMetrics:
    """Counts one engine's work in the process's Prometheus registry (label engine=`engine`)."""

    def __init__(self, engine: str):
        self.engine = EngineMetrics(engine)
        self._clocks: dict[str, RequestClock] = {}  # per request: TTFT / ITL / E2E

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        self._clocks[request_id] = RequestClock()
        self.engine.prompt_tokens.inc(num_prompt_tokens)

    def request_imported(self, request_id: str) -> None:
        self._clocks[request_id] = RequestClock(arrived=False)

    def request_closed(self, request_id: str) -> None:
        self._clocks.pop(request_id, None)

    def all_requests_failed(self) -> None:
        self._clocks.clear()

    def tokens(self, request_id: str, num_tokens: int, now_s: float) -> None:
        clock = self._clocks.get(request_id)
        if clock is not None:
            clock.tokens(self.engine, num_tokens, now_s)

    def finished(self, request_id: str, finish_reason: str, now_s: float) -> None:
        clock = self._clocks.get(request_id)
        if clock is not None:
            clock.finished(self.engine, finish_reason, now_s)

    def nonfinite_logits(self) -> None:
        self.engine.nonfinite_logits.inc()

    def request_orphaned(self) -> None:
        self.engine.orphaned_requests.inc()

    def iteration(self, mode: str, seconds: float) -> None:
        self.engine.iteration(mode, seconds)

    def state(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int,
              num_preemptions: int) -> None:
        self.engine.set_state(num_running, num_waiting, kv_blocks_used, kv_blocks_total, num_preemptions)

    def prefix_cache(self, medium: str, num_query_tokens: int, num_hit_tokens: int, num_cached_blocks: int) -> None:
        self.engine.set_prefix_cache(medium, num_query_tokens, num_hit_tokens, num_cached_blocks)
