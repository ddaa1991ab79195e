"""How long the calling thread has been runnable without a core: the second field of Linux's
/proc/thread-self/schedstat (time spent waiting on a run queue, ns; needs schedstats, on by
default). A step timeline records its difference over a step, so "time without a core" is
measured, not inferred. 0 where it cannot be
read (another OS): then every difference is 0."""

from __future__ import annotations

_PATH = "/proc/thread-self/schedstat"


def runqueue_wait_ns() -> int:
    try:
        with open(_PATH, "rb") as file:
            return int(file.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
