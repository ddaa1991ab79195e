"""EngineLoop: runs an EngineCore on its own clock inside a daemon.

Steps run in one worker thread (torch releases the GIL), so the asyncio event
loop keeps serving RPCs meanwhile. Commands (add, abort, pause, import...) are
queued and applied between steps, in the event-loop thread, so the pure
scheduler is never touched by two threads at once. Each request's output goes
to its RequestChannel.

Liveness: an optional callback (`set_alive_callback`; the systemd watchdog ping) runs in
the event-loop thread after a step completes and while idle, at most once per
interval; a step that never returns stops the calls, which is the point.

Shutdown: `start_draining()` refuses new requests and imports with Unavailable
while running ones continue; `wait_drained(timeout_s)` waits for them, and
`abort_all()` ends whatever is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dualpace.engine.channel import RequestChannel
from dualpace.engine.core import EngineCore
from dualpace.engine.gate import IterationGate
from dualpace.engine.transfer.handoff_holds import HandoffHolds
from dualpace.engine.load import EngineLoad
from dualpace.engine.metrics_sink import MetricsSink, NoMetrics
from dualpace.engine.request import RequestEvent
from dualpace.engine.step_window import StepLatencyWindow
from dualpace.errors import RequestNotFound, Unavailable
from dualpace.sampling import FinishReason, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

NUM_FINISHED_CHANNELS_KEPT = 1024  # finished requests a late stream may still read


def nonfinite_logits_message(request_id: str, engine_name: str) -> str:
    return (f"request {request_id!r} failed on engine {engine_name}: non-finite logits (NaN or Inf); "
            "the request was ended, the engine serves on")


class EngineLoop:
    def __init__(self, core: EngineCore, step_lock: threading.Lock | None = None,
                 gate: IterationGate | None = None, metrics: MetricsSink | None = None):
        self.core = core
        self.channels: dict[str, RequestChannel] = {}
        self._finished: OrderedDict[str, RequestChannel] = OrderedDict()
        self._commands: deque[tuple[Callable[[], Any], asyncio.Future]] = deque()
        self._wake = asyncio.Event()
        self._parked = False  # the loop's task waits in _idle: no step in flight, none starting
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{core.config.name}-step")
        self._step_ms = StepLatencyWindow()  # steps that did work only
        # Held for each step; gpu_service shares it with Dense Assist so both use the device in turn.
        self._step_lock = step_lock or contextlib.nullcontext()
        self.gate = gate or IterationGate()  # iteration boundaries, for the gated baseline policy
        self._stopping = False
        self.draining = False  # new requests refused; running ones continue
        self.serving = True
        self.step_delay_s = 0.0  # test-only fault: each step sleeps this long (--fault-step-delay-ms)
        self._on_alive: Callable[[], None] | None = None
        self._alive_interval_s = 0.0
        self._last_alive = float("-inf")
        self.fatal_error: BaseException | None = None
        self.stopped = asyncio.Event()
        # Reported here, after steps and commands, never in the scheduler; the daemon passes Prometheus.
        self.metrics: MetricsSink = metrics or NoMetrics()
        self._iteration_s = 0.0  # the last step's model time (inside the step lock)
        self.step_timeline = None  # a StepTimeline (dualpace.engine.step_timeline): one record per step run
        self._last_recorded_step_id = -1
        self._event_loop: asyncio.AbstractEventLoop | None = None
        # Requests held after their first token for a hand-off: their move takes them without a boundary.
        self.holds = HandoffHolds(core, self.call)

    # ----------------------------------------------------------------- commands

    async def call(self, command: Callable[[], T], wake: bool = True) -> T:
        """Run `command` in the loop between steps and return its result (or raise its error).
        wake=False: an idle loop is not woken to look for the work the command made; the caller
        calls wake() soon (an import's commit: after its reply is sent, so that the first step of
        the request it made does not hold up that reply)."""
        if self.fatal_error is not None or self._stopping:
            raise Unavailable(f"engine {self.core.config.name} is not serving")
        if self._parked and not self._commands:
            # No step is in flight, and none can start before this returns: steps start only from
            # the loop's task, which is parked in _idle. So this is a step boundary already, and
            # the command runs now (in queue order: none is waiting) instead of after a hop through
            # that task and back. The loop is woken to look for work the command made.
            result = command()
            self.update_metrics()
            if wake:
                self._wake.set()
            return result
        future = asyncio.get_running_loop().create_future()
        self._commands.append((command, future))
        self._wake.set()
        return await future

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          num_prior_output_tokens: int = 0, hold_after_first_token: bool = False) -> RequestChannel:
        def add() -> RequestChannel:
            self.check_accepting()
            # The channel is registered in the same command, so no step can emit before it exists.
            request = self.core.add_request(request_id, prompt_token_ids, params, num_prior_output_tokens,
                                            hold_after_first_token)
            channel = RequestChannel(request_id, len(request.prompt_token_ids))
            self.channels[request_id] = channel
            self.metrics.request_added(request_id, len(request.prompt_token_ids))
            return channel

        return await self.call(add)

    def check_accepting(self) -> None:
        """Raise Unavailable when the engine takes no new work (draining for shutdown)."""
        if self.draining:
            raise Unavailable(f"engine {self.core.config.name} is shutting down; send new requests elsewhere")

    async def abort(self, request_id: str) -> None:
        event = await self.call(lambda: self.core.abort(request_id))
        await self._dispatch([event])

    def channel(self, request_id: str) -> RequestChannel:
        channel = self.channels.get(request_id) or self._finished.get(request_id)
        if channel is None:
            raise RequestNotFound(request_id)
        return channel

    def add_channel(self, channel: RequestChannel) -> None:
        """Register the channel of a request that arrived by import (call inside a command)."""
        self.channels[channel.request_id] = channel
        self.metrics.request_imported(channel.request_id)

    async def dispatch(self, events: list[RequestEvent]) -> None:
        """Publish events produced by a command (e.g. a release after migration)."""
        await self._dispatch(events)

    # ----------------------------------------------------------------- the loop

    def wake(self) -> None:
        """Look for work now (after call(..., wake=False))."""
        self._wake.set()

    def _wake_from_any_thread(self) -> None:
        event_loop = self._event_loop
        if event_loop is None:
            return
        try:
            event_loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the event loop is closed: nothing left to wake
            pass

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._event_loop = loop
        desk = getattr(getattr(self.core, "runner", None), "desk", None)  # a core without a runner: none
        if desk is not None:  # a join offered while idle starts a step for it
            desk.on_pending(self._wake_from_any_thread)
        try:
            while not self._stopping:
                if self._commands:
                    self._run_commands()
                    self.update_metrics()
                if not self.core.has_work:
                    self._wake.clear()
                    if not self._commands and not self._stopping:
                        await self._idle()
                    continue
                start = time.perf_counter()
                plan, events = await loop.run_in_executor(self._executor, self._step)
                self._step_ms.record((time.perf_counter() - start) * 1e3, plan.is_empty)
                if not plan.is_empty:
                    self.metrics.iteration(self._iteration_mode(), self._iteration_s)
                self.update_metrics()
                self._maybe_alive()
                self.holds.register(events)  # at this boundary, before the router can see the first token
                await self._dispatch(events)
        except Exception as exc:  # the forward pass failed: this engine cannot continue
            log.exception("engine step failed")
            self.fatal_error = exc
            self.serving = False
            for command, future in self._commands:
                if not future.done():
                    future.set_exception(Unavailable(f"engine failed: {exc}"))
            for channel in list(self.channels.values()):
                await channel.fail(f"engine {self.core.config.name} failed: {exc}")
            self.metrics.all_requests_failed()
        finally:
            self.stopped.set()

    async def _idle(self) -> None:
        """Wait for a command; with a liveness callback, wake up to call it every interval. While
        parked here no step runs, so call() runs its command at once (see there)."""
        self._parked = True
        try:
            if self._on_alive is None:
                await self._wake.wait()
                return
            while not self._wake.is_set():
                self._maybe_alive()
                try:
                    await asyncio.wait_for(self._wake.wait(), self._alive_interval_s)
                except TimeoutError:
                    pass
        finally:
            self._parked = False

    def set_alive_callback(self, callback: Callable[[], None] | None, interval_s: float) -> None:
        """Call `callback` after steps and while idle, at most once per `interval_s`."""
        if callback is not None and interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._on_alive = callback
        self._alive_interval_s = interval_s
        self._last_alive = float("-inf")
        self._wake.set()  # an idle loop picks up the new interval

    def _maybe_alive(self) -> None:
        if self._on_alive is None:
            return
        now = time.monotonic()
        if now - self._last_alive < self._alive_interval_s:
            return
        self._last_alive = now
        try:
            self._on_alive()
        except Exception:  # a failed ping must not stop the engine
            log.exception("liveness callback failed")

    def _step(self):
        self.gate.step_started()
        try:
            with self._step_lock:
                if self.step_delay_s > 0:
                    time.sleep(self.step_delay_s)
                start = time.perf_counter()
                start_ns = time.monotonic_ns()
                result = self.core.step()
                self._iteration_s = time.perf_counter() - start
                if self.step_timeline is not None:
                    self._record_step(result[0], start_ns, time.monotonic_ns())
                return result
        finally:
            self.gate.step_finished()

    def _record_step(self, plan, start_ns: int, end_ns: int) -> None:
        """One StepRecord for a step that ran; the runner adds what it knows (joins, how, waits)."""
        step_id = getattr(self.core.runner, "num_executed_steps", self.core.num_steps)
        if step_id == self._last_recorded_step_id:
            return  # nothing ran (an early return): the runner's fields are the last step's
        extra = dict(getattr(self.core.runner, "last_step_record_fields", None) or {})
        if plan.is_empty and not extra.get("joins"):
            return
        self._last_recorded_step_id = step_id
        from dualpace.engine.step_timeline import JoinedRows  # only with a timeline configured
        extra["joins"] = tuple(JoinedRows(*join) for join in extra.get("joins", ()))
        own = plan.sequences
        self.step_timeline.record_step(
            engine=self.core.config.name, step_id=step_id, start_ns=start_ns, end_ns=end_ns,
            mode=self._iteration_mode(), num_own_rows=len(own),
            num_prefill_rows=sum(len(s.token_ids) for s in own if len(s.token_ids) > 1), **extra)

    def _iteration_mode(self) -> str:
        """How the last step ran: gpu (gpu_service), or the CPU runner's local / assisted."""
        mode = getattr(self.core.runner, "last_mode", None)
        if mode is not None:
            return str(getattr(mode, "value", mode))
        return "gpu" if self.core.config.kind == "gpu" else "local"

    def update_metrics(self) -> None:
        """Report the engine's state to the metrics (cheap: a few attribute reads)."""
        scheduler = self.core.scheduler
        blocks = scheduler.blocks
        self.metrics.state(scheduler.num_running, scheduler.num_waiting, scheduler.num_used_blocks,
                           blocks.num_total_blocks, scheduler.num_preemptions)
        if (prefix_cache := scheduler.prefix_cache) is not None:
            self.metrics.prefix_cache(self.core.config.kind, prefix_cache.num_query_tokens,
                                      prefix_cache.num_hit_tokens, blocks.num_cached_blocks)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def start_draining(self) -> None:
        """Refuse new requests and imports from now on (Unavailable); running ones continue."""
        self.draining = True

    @property
    def parked(self) -> bool:
        """The loop waits for work: no step in flight, and call() runs its command at once."""
        return self._parked

    @property
    def num_requests(self) -> int:
        """Requests this engine holds: waiting, running or paused for a migration."""
        return len(self.core.scheduler.requests)

    async def wait_drained(self, timeout_s: float, poll_s: float = 0.02) -> bool:
        """Until no request is left (True) or timeout_s passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.num_requests and not self.stopped.is_set():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    async def abort_all(self) -> int:
        """Abort every request left (their streams end with ABORT); returns how many."""
        def abort_every() -> list[RequestEvent]:
            return [self.core.abort(request_id) for request_id in list(self.core.scheduler.requests)]

        events = await self.call(abort_every)
        await self._dispatch(events)
        return len(events)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _run_commands(self) -> None:
        while self._commands:
            command, future = self._commands.popleft()
            if future.done():
                continue
            try:
                future.set_result(command())
            except Exception as exc:
                future.set_exception(exc)

    async def _dispatch(self, events: list[RequestEvent]) -> None:
        now_s = time.perf_counter()
        for event in events:
            error_message = None
            if event.finish_reason == FinishReason.ERROR:
                # The one error a step ends a request with: its logits were not finite (Scheduler.apply).
                # Its blocks are already free; the rest of the batch went on; the engine keeps serving.
                error_message = nonfinite_logits_message(event.request_id, self.core.config.name)
                self.metrics.nonfinite_logits()
                log.warning("%s", error_message)
            channel = self.channels.get(event.request_id)
            if channel is None:
                continue
            await channel.publish(event, error_message)
            self.metrics.tokens(event.request_id, len(event.new_token_ids), now_s)
            if event.finish_reason is not None:
                self.metrics.finished(event.request_id, event.finish_reason.value, now_s)
            if channel.done:
                self.metrics.request_closed(event.request_id)
                del self.channels[event.request_id]
                self._finished[event.request_id] = channel
                while len(self._finished) > NUM_FINISHED_CHANNELS_KEPT:
                    self._finished.popitem(last=False)

    # ----------------------------------------------------------------- load

    def load(self) -> EngineLoad:
        core = self.core
        blocks = core.scheduler.blocks
        self.update_metrics()
        return EngineLoad(
            name=core.config.name,
            kind=core.config.kind,
            serving=self.serving and self.fatal_error is None and not self.draining,
            num_running=core.scheduler.num_running,
            num_waiting=core.scheduler.num_waiting,
            kv_blocks_total=blocks.num_total_blocks,
            kv_blocks_used=core.scheduler.num_used_blocks,  # not counting blocks reserved ahead of an import
            block_size=blocks.block_size,
            itl_p50_ms=self._step_ms.p50_ms,
            itl_p99_ms=self._step_ms.p99_ms,
            num_iterations=core.num_steps,
            num_preemptions=core.scheduler.num_preemptions,
            timestamp_unix_ms=int(time.time() * 1000),
            kv_blocks_cached=blocks.num_cached_blocks,
        )
