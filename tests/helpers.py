"""Helpers shared by the tests (fixtures live in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from dualpace.generation import OfflineGenerator
from dualpace.sampling import SamplingParams

T = TypeVar("T")


def reference_tokens(loaded, prompt: list[int], params: SamplingParams, block_size: int | None = None) -> list[int]:
    """What the request generates alone, in process (the OfflineGenerator reference path)."""
    generator = OfflineGenerator(loaded) if block_size is None else OfflineGenerator(loaded, block_size=block_size)
    return generator.generate([list(prompt)], [params])[0].output_token_ids


def wait_for(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, interval_s: float = 0.01) -> T:
    """Poll `probe` until `done(value)` or `timeout_s` is up; returns the last value (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Yield to the event loop until `condition()` holds; fails naming `what` past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.001)
