"""What an engine reports about itself: its load snapshot (LoadSnapshot on the wire) and a
summary of each request it holds (RequestInfo). Plain data, so the wire and the router read
it without the asyncio loop that makes it."""

from __future__ import annotations

from dataclasses import dataclass

from dualpace.engine.request import RequestState


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
    kv_blocks_cached: int = 0  # unowned blocks holding prefix-cache content (evicted before preempting)


@dataclass(frozen=True)
class RequestSummary:
    """One request an engine holds, as ListRequests reports it (state None: not one we know)."""

    request_id: str
    state: RequestState | None
    prompt_tokens: int
    generated_tokens: int
    kv_blocks: int
