"""RouterCore: the router's live state and its migration executor.

It holds only caches: the engines' load views, the requests it is relaying
(for admission and migration planning) and a log of recent migrations. The
engines hold the authoritative request state; ListPlacements asks them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from dualpace.model.config import ModelConfig
from dualpace.model.tokenizer import Tokenizer
from dualpace.policy.admission import AdmissionConfig
from dualpace.policy.host_tier import HostTierRule
from dualpace.policy.migration_planner import MigrationConfig, plan_migrations
from dualpace.policy.policies import Policy, traits
from dualpace.policy.views import EngineView, RoutedRequest
from dualpace.serve import metrics
from router.engines import EngineHandle, EnginePool
from router.prompt_work import PromptLimits, PromptWork

log = logging.getLogger(__name__)

PLANNER_INTERVAL_S = 0.1
NUM_MIGRATIONS_KEPT = 100


@dataclass
class MigrationRecord:
    request_id: str
    source: str
    target: str
    outcome: str  # "in_progress" | "committed" | "failed"
    timestamp_unix_ms: int
    detail: str = ""


@dataclass
class Tracked:
    """A request the router relays: where it is and how far it got."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    engine: EngineHandle | None = None
    num_generated_tokens: int = 0
    migrating: bool = False
    num_migrations: int = 0  # committed moves, the hand-off included
    # Its engine failed and no other can hold it: the name of the engine it waits for (paused).
    waiting_for: str | None = None

    def routed(self) -> RoutedRequest | None:
        if self.engine is None or self.waiting_for is not None:
            return None
        return RoutedRequest(self.request_id, self.engine.name, self.num_prompt_tokens, self.num_generated_tokens,
                             self.max_tokens, self.migrating, self.num_migrations)


def _used_share(views: list[EngineView]) -> float:
    total = sum(v.kv_blocks_total for v in views)
    return sum(v.kv_blocks_used for v in views) / total if total else 0.0


@dataclass
class RouterConfig:
    policy: Policy = Policy.DUALPACE
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    queue_timeout_s: float = 30.0  # how long a request may wait for room before RESOURCE_EXHAUSTED
    recovery_timeout_s: float = 30.0  # how long a request may wait for a surviving engine
    # How long a request no surviving engine can hold waits for its failed engine to come back
    # (--resume-wait-s): `dualpace up`'s restart back-off (0.5 s doubling to 8 s) and the systemd
    # units' RestartSec=2, plus an engine's start.
    resume_wait_s: float = 60.0
    migrate_enabled: bool = True
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)  # --max-prompt-chars, --prompt-workers
    host_tier: HostTierRule = field(default_factory=HostTierRule)  # continue on the CPU engine from its cached prefix


class RouterCore:
    def __init__(self, pool: EnginePool, tokenizer: Tokenizer, model_config: ModelConfig, config: RouterConfig):
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.config = config
        self.prompt_work = PromptWork(config.prompt_limits)  # tokenizing off the event loop
        self.tracked: dict[str, Tracked] = {}
        self.migrations: deque[MigrationRecord] = deque(maxlen=NUM_MIGRATIONS_KEPT)
        self.num_queued = 0
        self.changed = asyncio.Event()  # a request finished or moved: room may have appeared
        self._planner: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones
        metrics.register_callback_gauges(metrics.CallbackGauges(
            "dualpace_router_engine_healthy", "Whether the router sees the engine as healthy.", ("engine",),
            lambda: {(h.name,): float(h.healthy) for h in list(self.pool.handles)}))
        metrics.register_callback_gauges(metrics.CallbackGauges(
            "dualpace_router_requests", "Requests the router holds: placed on an engine, or queued for room.",
            ("state",), lambda: {("placed",): float(len(self.tracked) - self.num_queued),
                                 ("queued",): float(self.num_queued)}))
        # The names llm-d's endpoint picker scrapes from vLLM, so a node can stand behind it:
        # running and waiting over the healthy engines (waiting includes the router's own queue);
        # KV usage is the GPU tier (where requests are admitted), a fraction in [0, 1] like vLLM's.
        for name, documentation, read in (
                ("vllm:num_requests_running", "Requests in the engines' step loops.",
                 lambda views: sum(v.num_running for v in views)),
                ("vllm:num_requests_waiting", "Requests waiting in an engine or in the router's queue.",
                 lambda views: sum(v.num_waiting for v in views) + self.num_queued),
                ("vllm:kv_cache_usage_perc", "Share of the GPU engines' KV blocks in use (GPU tier).",
                 lambda views: _used_share([v for v in views if v.kind == "gpu"]))):
            metrics.register_callback_gauges(metrics.CallbackGauges(
                name, documentation, (), lambda read=read: {(): float(read(self._healthy_views()))}))

    def _healthy_views(self) -> list[EngineView]:
        return [view for view in self.pool.views().values() if view.healthy]

    @property
    def max_context_tokens(self) -> int:
        return self.model_config.max_position_embeddings

    def start(self) -> None:
        self.pool.start()
        if self.config.migrate_enabled and traits(self.config.policy).migrates:
            self._planner = asyncio.create_task(self._plan_forever())

    async def close(self) -> None:
        if self._planner is not None:
            self._planner.cancel()
        self.prompt_work.close()
        await self.pool.close()

    def spawn(self, coroutine) -> asyncio.Task:
        """Run a background task (a migration) that nothing awaits, keeping it alive until done."""
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def placed(self) -> list[RoutedRequest]:
        return [r for r in (t.routed() for t in self.tracked.values()) if r is not None]

    def notify(self) -> None:
        self.changed.set()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Until a load update, a finish or a move (or the timeout)."""
        self.changed.clear()
        self.pool.changed.clear()
        waiters = [asyncio.create_task(self.changed.wait()), asyncio.create_task(self.pool.changed.wait())]
        done, pending = await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()

    async def migrate(self, tracked: Tracked, target: EngineHandle, reason: str) -> bool:
        """Ask the request's engine to move it to `target`; the relay follows the move."""
        source = tracked.engine
        if source is None or tracked.migrating:
            return False
        tracked.migrating = True
        record = MigrationRecord(tracked.request_id, source.name, target.name, "in_progress", int(time.time() * 1000),
                                 reason)
        self.migrations.append(record)
        log.info("migration of %s %s -> %s started (%s, %d tokens generated)", tracked.request_id, source.name,
                 target.name, reason, tracked.num_generated_tokens)
        try:
            await source.migrate_out(tracked.request_id, target.address, timeout_s=60)
            record.outcome = "committed"
            tracked.num_migrations += 1
            metrics.migration(source.expected_kind, target.expected_kind, "committed")
            return True
        except grpc.aio.AioRpcError as exc:
            record.outcome = "failed"
            metrics.migration(source.expected_kind, target.expected_kind, "failed")
            record.detail = f"{reason}: {exc.code().name}: {exc.details()}"
            log.info("migration of %s %s -> %s failed: %s", tracked.request_id, source.name, target.name,
                     record.detail)
            return False
        finally:
            tracked.migrating = False

    async def _plan_forever(self) -> None:
        while True:
            await asyncio.sleep(PLANNER_INTERVAL_S)
            try:
                self._plan_once()
            except Exception:  # a planning bug must not stop the router
                log.exception("migration planning failed")

    def _plan_once(self) -> None:
        planned = plan_migrations(self.placed(), self.pool.views(), self.config.policy, self.config.migration)
        for move in planned:
            tracked = self.tracked.get(move.request_id)
            target = self.pool.by_name(move.target)
            if tracked is not None and target is not None and not tracked.migrating:
                tracked.migrating = True  # reserved now; migrate() runs it
                self.spawn(self._run_planned(tracked, target, move.reason))

    async def _run_planned(self, tracked: Tracked, target: EngineHandle, reason: str) -> None:
        tracked.migrating = False
        await self.migrate(tracked, target, reason)
