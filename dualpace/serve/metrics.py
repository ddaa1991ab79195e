"""Prometheus metrics of every DualPace daemon: one registry per process, the metric families,
cheap helpers that update them, and the HTTP exposition (`--metrics-port`).

Names follow what vLLM's users already graph (`num_requests_running`, `time_to_first_token_seconds`,
...) with the prefix `dualpace_`. Most families carry an `engine` label: in an engine daemon it is
the engine's own name; in the router it is the engine that produced (or was given) the tokens.

Who updates what, so the pure scheduler stays free of it:
- PrometheusLoopMetrics (dualpace.serve.engine_loop_metrics), the MetricsSink the engine daemon
  gives its EngineLoop: request gauges, KV blocks, preemptions after each step and
  command; iteration latency (mode gpu, or local/assisted on cpu_service); prompt/generation
  tokens, TTFT, ITL, E2E, finished requests and requests ended by non-finite logits from the
  events it dispatches.
- OrphanLeases (dualpace.serve.orphan_lease): requests aborted for want of a reader.
- CpuRunner: Dense Assist calls and their round trip.
- Router: the same request families from the relay, migrations from RouterCore.migrate, and the
  HTTP front's counters.
- StatusInterceptor: errors by gRPC status code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, start_http_server
from prometheus_client.registry import Collector

from dualpace.errors import InvalidArgument

disable_created_metrics()  # no `_created` series beside every counter and histogram
REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets as vLLM uses them (seconds), so dashboards built for it read these too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                     1.0, 2.5, 5.0, 10.0)

_ENGINE = ("engine",)

NUM_REQUESTS_RUNNING = Gauge("dualpace_num_requests_running", "Requests in the running batch.", _ENGINE,
                             registry=REGISTRY)
NUM_REQUESTS_WAITING = Gauge("dualpace_num_requests_waiting",
                             "Requests queued (new, or preempted and waiting to recompute).", _ENGINE,
                             registry=REGISTRY)
KV_BLOCKS_USED = Gauge("dualpace_kv_blocks_used", "KV cache blocks in use.", _ENGINE, registry=REGISTRY)
KV_BLOCKS_TOTAL = Gauge("dualpace_kv_blocks_total", "KV cache blocks in the pool.", _ENGINE, registry=REGISTRY)
KV_BLOCKS_CACHED = Gauge("dualpace_kv_blocks_cached",
                         "KV cache blocks no request holds that keep prefix content until evicted.", _ENGINE,
                         registry=REGISTRY)
# Counted in tokens, as vLLM counts them: each admission looks up all of its tokens.
PREFIX_CACHE_QUERIES = Counter("dualpace_prefix_cache_queries_total",
                               "Tokens of admitted requests looked up in the prefix cache, by medium (gpu, cpu).",
                               ("engine", "medium"), registry=REGISTRY)
PREFIX_CACHE_HITS = Counter("dualpace_prefix_cache_hits_total",
                            "Of the looked-up tokens, those whose KV the prefix cache held, by medium (gpu, cpu).",
                            ("engine", "medium"), registry=REGISTRY)
TIME_TO_FIRST_TOKEN = Histogram("dualpace_time_to_first_token_seconds",
                                "From a request's arrival to its first generated token.", _ENGINE,
                                buckets=TTFT_BUCKETS, registry=REGISTRY)
INTER_TOKEN_LATENCY = Histogram("dualpace_inter_token_latency_seconds",
                                "Between consecutive generated tokens of a request.", _ENGINE,
                                buckets=ITL_BUCKETS, registry=REGISTRY)
E2E_REQUEST_LATENCY = Histogram("dualpace_e2e_request_latency_seconds",
                                "From a request's arrival to its finish.", _ENGINE, buckets=E2E_BUCKETS,
                                registry=REGISTRY)
ITERATION_LATENCY = Histogram("dualpace_iteration_latency_seconds",
                              "One engine iteration (step), by how it ran: gpu, local or assisted.",
                              ("engine", "mode"), buckets=ITERATION_BUCKETS, registry=REGISTRY)
PROMPT_TOKENS = Counter("dualpace_prompt_tokens_total", "Prompt tokens of admitted requests.", _ENGINE,
                        registry=REGISTRY)
GENERATION_TOKENS = Counter("dualpace_generation_tokens_total", "Generated tokens.", _ENGINE, registry=REGISTRY)
REQUESTS = Counter("dualpace_requests_total", "Finished requests, by finish reason.", ("engine", "finish_reason"),
                   registry=REGISTRY)
PREEMPTIONS = Counter("dualpace_preemptions_total", "Requests preempted (to be recomputed) for lack of KV blocks.",
                      _ENGINE, registry=REGISTRY)
NONFINITE_LOGITS = Counter("dualpace_nonfinite_logits_total",
                           "Requests ended because their logits held NaN or Inf (the engine serves on).", _ENGINE,
                           registry=REGISTRY)
ORPHANED_REQUESTS = Counter("dualpace_orphaned_requests_total",
                            "Requests aborted because no stream re-attached within --orphan-timeout-s after "
                            "their reader (the router) went away.", _ENGINE, registry=REGISTRY)
MIGRATIONS = Counter("dualpace_migrations_total", "Migrations the router asked for (the hand-off included).",
                     ("direction", "outcome"), registry=REGISTRY)
DENSE_ASSIST_CALLS = Counter("dualpace_dense_assist_calls_total",
                             "Assisted iterations: ok, or fallback (redone locally).", ("engine", "outcome"),
                             registry=REGISTRY)
DENSE_ASSIST_ROUND_TRIP = Histogram("dualpace_dense_assist_round_trip_seconds",
                                    "One successful assisted iteration, every layer's round trip to gpu_service.",
                                    _ENGINE, buckets=ITERATION_BUCKETS, registry=REGISTRY)
ERRORS = Counter("dualpace_errors_total", "RPCs that ended with an error status, by gRPC status code.", ("code",),
                 registry=REGISTRY)

class HttpMetrics:
    """The router's HTTP front (router/http_api.py; documented in docs/http_api.md). Created on first
    use (`http_metrics()`), so that daemons without an HTTP front do not export these at zero."""

    def __init__(self) -> None:
        self.requests = Counter("dualpace_http_requests_total", "HTTP requests answered, by endpoint and status "
                                "(client_closed: the client went away first).", ("endpoint", "status"),
                                registry=REGISTRY)
        self.prompt_tokens = Counter("dualpace_http_prompt_tokens_total",
                                     "Prompt tokens of admitted HTTP generation requests.", registry=REGISTRY)
        self.generation_tokens = Counter("dualpace_http_generation_tokens_total", "Tokens generated for HTTP requests.",
                                         registry=REGISTRY)
        self.running = Gauge("dualpace_http_requests_running", "HTTP generation requests in progress.",
                             registry=REGISTRY)


_http_metrics: HttpMetrics | None = None


def http_metrics() -> HttpMetrics:
    global _http_metrics
    if _http_metrics is None:
        _http_metrics = HttpMetrics()
    return _http_metrics


class EngineMetrics:
    """One engine's label children, bound once so that per-step updates are cheap. Each EngineLoop
    has its own (it tracks the scheduler's preemption total); children are shared by label."""

    def __init__(self, engine: str):
        self.engine = engine
        # State gauges appear only once set_state runs (an engine): the router, which counts
        # tokens by engine too, must not export zeros for the engines' state.
        self._state: tuple[Gauge, Gauge, Gauge, Gauge, Counter] | None = None
        self.ttft = TIME_TO_FIRST_TOKEN.labels(engine)
        self.itl = INTER_TOKEN_LATENCY.labels(engine)
        self.e2e = E2E_REQUEST_LATENCY.labels(engine)
        self.prompt_tokens = PROMPT_TOKENS.labels(engine)
        self.generation_tokens = GENERATION_TOKENS.labels(engine)
        self._iteration: dict[str, Histogram] = {}
        self._nonfinite_logits: Counter | None = None
        self._finished: dict[str, Counter] = {}
        self._num_preemptions_seen = 0
        self._prefix_cache: tuple[Counter, Counter, Gauge] | None = None
        self._prefix_tokens_seen = (0, 0)  # (queries, hits) already added to the counters

    def set_state(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int,
                  num_preemptions: int) -> None:
        """Gauges from the engine's state; `num_preemptions` is the scheduler's running total."""
        if self._state is None:
            self._state = tuple(family.labels(self.engine) for family in (
                NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_BLOCKS_USED, KV_BLOCKS_TOTAL, PREEMPTIONS))
            _ = self.nonfinite_logits  # an engine exports its counts from the start, at 0
            _ = self.orphaned_requests
        running, waiting, kv_used, kv_total, preemptions = self._state
        running.set(num_running)
        waiting.set(num_waiting)
        kv_used.set(kv_blocks_used)
        kv_total.set(kv_blocks_total)
        if num_preemptions > self._num_preemptions_seen:
            preemptions.inc(num_preemptions - self._num_preemptions_seen)
        self._num_preemptions_seen = num_preemptions

    def set_prefix_cache(self, medium: str, num_query_tokens: int, num_hit_tokens: int,
                         num_cached_blocks: int) -> None:
        """The prefix cache's running token totals (queries, hits) and its cached blocks now."""
        if self._prefix_cache is None:
            self._prefix_cache = (PREFIX_CACHE_QUERIES.labels(self.engine, medium),
                                  PREFIX_CACHE_HITS.labels(self.engine, medium), KV_BLOCKS_CACHED.labels(self.engine))
        queries, hits, cached = self._prefix_cache
        seen_queries, seen_hits = self._prefix_tokens_seen
        if num_query_tokens > seen_queries:
            queries.inc(num_query_tokens - seen_queries)
        if num_hit_tokens > seen_hits:
            hits.inc(num_hit_tokens - seen_hits)
        self._prefix_tokens_seen = (num_query_tokens, num_hit_tokens)
        cached.set(num_cached_blocks)

    @property
    def nonfinite_logits(self) -> Counter:
        """Requests this engine ended for non-finite logits (created on first use, like the state gauges)."""
        if self._nonfinite_logits is None:
            self._nonfinite_logits = NONFINITE_LOGITS.labels(self.engine)
        return self._nonfinite_logits

    @property
    def orphaned_requests(self) -> Counter:
        """Requests this engine aborted when their orphan lease expired (dualpace.serve.orphan_lease)."""
        return ORPHANED_REQUESTS.labels(self.engine)

    def iteration(self, mode: str, seconds: float) -> None:
        child = self._iteration.get(mode)
        if child is None:
            child = self._iteration[mode] = ITERATION_LATENCY.labels(self.engine, mode)
        child.observe(seconds)

    def finished(self, finish_reason: str) -> None:
        child = self._finished.get(finish_reason)
        if child is None:
            child = self._finished[finish_reason] = REQUESTS.labels(self.engine, finish_reason)
        child.inc()


_engine_metrics: dict[str, EngineMetrics] = {}
_engine_metrics_lock = threading.Lock()


def engine_metrics(engine: str) -> EngineMetrics:
    """A shared EngineMetrics of `engine`, for counting requests by engine (the router)."""
    with _engine_metrics_lock:
        metrics = _engine_metrics.get(engine)
        if metrics is None:
            metrics = _engine_metrics[engine] = EngineMetrics(engine)
        return metrics


class RequestClock:
    """Latencies of one request from its token events: TTFT at the first token, ITL between tokens,
    E2E at the finish. A request that arrived by migration (`arrived=False`) has no TTFT or E2E
    here; its first tokens after the import count as ITL from the moment it arrived."""

    __slots__ = ("arrived", "last_s", "start_s")

    def __init__(self, now_s: float | None = None, arrived: bool = True):
        now_s = time.perf_counter() if now_s is None else now_s
        self.start_s = now_s
        self.last_s: float | None = None if arrived else now_s
        self.arrived = arrived

    def tokens(self, metrics: EngineMetrics, num_tokens: int, now_s: float | None = None) -> None:
        if num_tokens <= 0:
            return
        now_s = time.perf_counter() if now_s is None else now_s
        metrics.generation_tokens.inc(num_tokens)
        remaining = num_tokens
        if self.last_s is None:
            metrics.ttft.observe(now_s - self.start_s)
            remaining -= 1
        if remaining > 0:  # several tokens in one event: each gets an equal share of the gap
            gap = (now_s - self.last_s) / remaining if self.last_s is not None else 0.0
            for _ in range(remaining):
                metrics.itl.observe(gap)
        self.last_s = now_s

    def finished(self, metrics: EngineMetrics, finish_reason: str, now_s: float | None = None) -> None:
        now_s = time.perf_counter() if now_s is None else now_s
        metrics.finished(finish_reason)
        if self.arrived:
            metrics.e2e.observe(now_s - self.start_s)


def migration(source_kind: str, target_kind: str, outcome: str) -> None:
    """Count one migration (direction e.g. gpu_to_cpu; outcome committed | failed)."""
    MIGRATIONS.labels(f"{source_kind}_to_{target_kind}", outcome).inc()


def error(code_name: str) -> None:
    ERRORS.labels(code_name).inc()


class CallbackGauges(Collector):
    """Gauges read at scrape time from `read()` -> {(label values...): value}; for state that lives
    elsewhere (the router's view of the engines). `read` runs in the exposition thread: it must
    only read plain attributes."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...],
                 read: Callable[[], dict[tuple[str, ...], float]]):
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.read = read

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        try:
            values = self.read()
        except Exception:  # noqa: BLE001 - a scrape must not fail on a racing update
            values = {}
        for labels, value in values.items():
            family.add_metric(list(labels), value)
        return [family]


def register_callback_gauges(gauges: CallbackGauges) -> CallbackGauges:
    """Register (replacing one of the same name, e.g. from an earlier in-process router)."""
    for collector in list(REGISTRY._collector_to_names):  # no public lookup by name
        if isinstance(collector, CallbackGauges) and collector.name == gauges.name:
            REGISTRY.unregister(collector)
    REGISTRY.register(gauges)
    return gauges


def render() -> bytes:
    """The registry in Prometheus text format (Content-Type: CONTENT_TYPE)."""
    return generate_latest(REGISTRY)


def add_metrics_argument(parser) -> None:
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on 127.0.0.1:PORT (0: a free port; absent: off)")


def start_metrics_server(port: int, host: str = "127.0.0.1", field: str = "--metrics-port") -> str:
    """Serve the registry over HTTP (any path, e.g. /metrics) from a daemon thread; returns HOST:PORT
    with the real port. Raises InvalidArgument when the port is out of range or cannot be bound."""
    if not 0 <= port <= 65535:
        raise InvalidArgument(field, f"must be a port number 0-65535, got {port}")
    try:
        server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        raise InvalidArgument(field, f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return f"{host}:{server.server_port}"


def start_from_args(args, process_name: str) -> str | None:
    """Start the exposition when `--metrics-port` was given; print `NAME metrics on ADDR`."""
    if getattr(args, "metrics_port", None) is None:
        return None
    address = start_metrics_server(args.metrics_port)
    print(f"{process_name} metrics on {address}", flush=True)
    return address
