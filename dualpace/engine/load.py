"""An engine's load snapshot: what it reports to the router (LoadSnapshot on the wire).
Plain data, so the wire and the router read it without the asyncio loop that makes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    name: str
    kind: str
    serving: bool
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    itl_p50_ms: float
    itl_p99_ms: float
    num_iterations: int
    num_preemptions: int
    timestamp_unix_ms: int
