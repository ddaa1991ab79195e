"""When `dualpace up` restarts a daemon that exited by itself (systemd's Restart=on-failure with
StartLimitBurst / StartLimitIntervalSec): a bounded number of restarts within a sliding window,
each after a backoff that doubles with every recent exit. Pure: the caller passes the clock."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_RESTARTS = 5
DEFAULT_WINDOW_S = 60.0
DEFAULT_INITIAL_BACKOFF_S = 0.5
DEFAULT_MAX_BACKOFF_S = 8.0


@dataclass
class RestartBudget:
    max_restarts: int = DEFAULT_MAX_RESTARTS  # restarts allowed within window_s; 0: never restart
    window_s: float = DEFAULT_WINDOW_S
    initial_backoff_s: float = DEFAULT_INITIAL_BACKOFF_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    restarts_s: list[float] = field(default_factory=list)  # when each restart within the window was granted

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")

    def on_exit(self, now_s: float) -> float | None:
        """A daemon exited unexpectedly at now_s: the delay before restarting it, or None when
        the budget is spent (max_restarts restarts already within the last window_s)."""
        self.restarts_s = [t for t in self.restarts_s if now_s - t < self.window_s]
        if len(self.restarts_s) >= self.max_restarts:
            return None
        delay_s = min(self.max_backoff_s, self.initial_backoff_s * 2 ** len(self.restarts_s))
        self.restarts_s.append(now_s)
        return delay_s

    @property
    def num_recent(self) -> int:
        """Restarts granted within the window as of the last on_exit."""
        return len(self.restarts_s)
