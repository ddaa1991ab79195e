"""Bounded worker pools for the blocking work a daemon does beside its step loop, one pool per kind
of work, so that one kind cannot starve another: the same-host KV copy (kv_shm_send) and the
data socket's connects, sends and receives (kv_tcp_data's pools) here; gpu_service's Dense
Assist stages have their own (gpu_service/assist_limits.py). asyncio's default pool is shared by
everything in the process (and by asyncio.to_thread), so a burst of one kind of call waiting
there would delay the rest.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

KV_TRANSFER_WORKERS = 2  # the same-host copy's threads: each transfer is copied by one of them

_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def pool(name: str, max_workers: int) -> ThreadPoolExecutor:
    """The process's pool named `name` (created on first use with max_workers threads)."""
    with _pools_lock:
        executor = _pools.get(name)
        if executor is None:
            executor = _pools[name] = ThreadPoolExecutor(max_workers, thread_name_prefix=name)
        return executor


async def run_in_pool(name: str, function: Callable[..., T], *args, max_workers: int) -> T:
    """`function(*args)` in the pool `name` (of max_workers threads), awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(pool(name, max_workers), function, *args)
