"""The meeting point of assist sessions that want their rows in the GPU engine's next step
(remote rows: docs/architecture.md describes the timeline) and the engine's step thread.

A session's thread calls `offer()` and blocks there until the step thread finished the join
(TAKEN_DONE: its result went out through its channel), dropped it mid-step (DROPPED: its
channel's `fail` was called, `join.error` says with what), or did not take it in time
(NOT_TAKEN: the session runs the iteration staged, or waits on under gated). The step thread
calls `take()` at step start, `step_progress()` between layers and `end_step()` at the end;
`settle()` records each taken join's outcome. All methods are thread-safe.

No torch here: the channel's tensors pass through untouched.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dualpace.errors import Unavailable

log = logging.getLogger(__name__)


class RemoteRowsChannel(Protocol):
    """One join's exchange with its CPU engine, used by the step thread only."""

    def send_qkv(self, layer: int, q: Any, k: Any, v: Any) -> None:
        """The join's rows' q [rows, heads, dim], k and v [rows, kv_heads, dim] of `layer`."""

    def receive_attention(self, layer: int, deadline_s: float) -> Any | None:
        """The attention output [rows, heads * dim] of `layer`, or None when it did not come by
        `deadline_s` (time.monotonic()) or the peer is gone."""

    def finish(self, logits_rows: Any, info: Any) -> None:
        """The join's float32 logits rows after the last layer, and how the step ran (JoinStepInfo)."""

    def fail(self, error: BaseException) -> None:
        """The step will not finish this join (Overloaded: dropped mid-step; Unavailable: the step failed)."""


class JoinOutcome(enum.Enum):
    TAKEN_DONE = "taken_done"  # the step ran the join to the end; its result went out through its channel
    DROPPED = "dropped"  # taken, then dropped (channel.fail was called with join.error)
    NOT_TAKEN = "not_taken"  # no step took it in time (or the running step could not end in time)


@dataclass
class JoinRequest:
    """An assisted iteration's rows offered to the engine's next step. begin: the AssistBegin
    (token_ids, positions, sampling); channel: its RemoteRowsChannel; offered_s: time.monotonic()."""

    begin: Any
    channel: RemoteRowsChannel
    offered_s: float
    outcome: JoinOutcome | None = None
    error: BaseException | None = None  # with DROPPED: what the channel was failed with
    _settled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def num_rows(self) -> int:
        return len(self.begin.token_ids)


@dataclass(frozen=True)
class JoinStepInfo:
    """How the step that carried a join ran (passed to channel.finish; the wire's AssistJoinInfo)."""

    engine_step_id: int
    how: str  # "joined" | "split"
    gpu_wait_us: int  # the step blocked on this join's attention, summed over layers
    step_start_ns: int  # time.monotonic_ns()
    step_end_ns: int


class JoinDesk:
    """Pending joins (FIFO) and the running step's progress, for a model of `num_layers` layers."""

    def __init__(self, num_layers: int, clock: Callable[[], float] = time.monotonic):
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        self.num_layers = num_layers
        self._clock = clock
        self._lock = threading.Condition()
        self._pending: list[JoinRequest] = []
        self._taken: list[JoinRequest] = []  # by the running step, not settled yet
        self._listeners: list[Callable[[], None]] = []
        self._step_running = False
        self._layers_done = 0  # in the running step
        self._layer_ms = 0.0  # the last layer's time, for the "would it end in time" estimate
        self.num_steps = 0  # steps that took at least one join

    # ------------------------------------------------------------ session side

    def offer(self, join: JoinRequest, max_wait_s: float, decline_when_late: bool = True) -> JoinOutcome:
        """Block until a step took and settled `join`, or for at most `max_wait_s` while nobody took
        it (NOT_TAKEN). decline_when_late (dualpace): NOT_TAKEN at once when a step is running
        that has more than one layer left or whose remaining layers would outlast `max_wait_s`.
        gated passes its stage timeout with decline_when_late=False."""
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        with self._lock:
            if decline_when_late and self._step_running and self._ends_after(max_wait_s):
                return JoinOutcome.NOT_TAKEN
            self._pending.append(join)
            listeners = list(self._listeners)
        for wake in listeners:  # outside the lock: a listener may take it at once
            wake()
        deadline = self._clock() + max_wait_s
        with self._lock:
            while join in self._pending:
                left = deadline - self._clock()
                if left <= 0:
                    self._pending.remove(join)
                    return JoinOutcome.NOT_TAKEN
                self._lock.wait(left)
        join._settled.wait()  # taken: the step settles every join it took (end_step at the latest)
        return join.outcome

    def withdraw(self, join: JoinRequest) -> bool:
        """Take back a join not taken yet (its session is closing); False when a step has it."""
        with self._lock:
            if join not in self._pending:
                return False
            self._pending.remove(join)
            join.outcome = JoinOutcome.NOT_TAKEN
            join._settled.set()
            self._lock.notify_all()
        return True

    def on_pending(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the offering thread) whenever a join is offered."""
        with self._lock:
            self._listeners.append(callback)

    @property
    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    # ------------------------------------------------------------ step side

    def take(self, max_rows: int) -> list[JoinRequest]:
        """At step start: the pending joins, oldest first, while their rows fit `max_rows`. Marks a
        step running (end_step ends it) even when nothing is taken."""
        with self._lock:
            self._step_running = True
            self._layers_done = 0
            taken: list[JoinRequest] = []
            num_rows = 0
            for join in list(self._pending):
                if num_rows + join.num_rows > max_rows:
                    break
                num_rows += join.num_rows
                taken.append(join)
                self._pending.remove(join)
            self._taken.extend(taken)
            if taken:
                self.num_steps += 1
                self._lock.notify_all()
            return taken

    def step_progress(self, layer: int, layer_ms: float) -> None:
        """Layer `layer` of the running step just finished, in `layer_ms`."""
        with self._lock:
            self._layers_done = layer + 1
            self._layer_ms = layer_ms

    def settle(self, join: JoinRequest, outcome: JoinOutcome, error: BaseException | None = None) -> None:
        """Record a taken join's outcome: TAKEN_DONE after channel.finish, DROPPED after
        channel.fail(error), NOT_TAKEN when the step declined it before any of its rows ran (the
        planner found staged stages cheaper: the session runs it staged, as if never taken)."""
        with self._lock:
            if join in self._taken:
                self._taken.remove(join)
        join.outcome, join.error = outcome, error
        join._settled.set()

    def fail_taken(self, error: BaseException) -> None:
        """Fail every taken, unsettled join with `error` (the step failed: Unavailable)."""
        with self._lock:
            taken, self._taken = self._taken, []
        for join in taken:
            try:
                join.channel.fail(error)
            except Exception:  # one broken channel must not keep the others waiting
                log.exception("failing a join's channel failed")
            self.settle(join, JoinOutcome.DROPPED, error)

    def end_step(self) -> None:
        """The step is over: a taken join it left unsettled is failed (nothing waits forever)."""
        self.fail_taken(Unavailable("the engine step ended without finishing this join"))
        with self._lock:
            self._step_running = False
            self._layers_done = 0

    def _ends_after(self, max_wait_s: float) -> bool:
        layers_left = self.num_layers - self._layers_done
        return layers_left > 1 or layers_left * self._layer_ms > max_wait_s * 1e3
