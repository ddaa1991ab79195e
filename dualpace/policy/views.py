"""What the router's pure decision code sees: engine load views and the requests it relays.

Plain frozen dataclasses and arithmetic only — no torch, grpc, asyncio or clock reads,
so the simulator can run the same admission and migration code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class EngineView:
    """The router's latest view of one engine (from its load snapshot stream)."""

    name: str
    kind: str  # "gpu" | "cpu"
    healthy: bool
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    num_running: int
    num_waiting: int
    itl_p50_ms: float
    itl_p99_ms: float
    kv_blocks_cached: int = 0  # unowned blocks holding prefix-cache content; free space for placement
    num_preemptions: int = 0  # the engine's preemptions by recompute since it started (a running total)

    @property
    def kv_blocks_free(self) -> int:
        return max(0, self.kv_blocks_total - self.kv_blocks_used)

    def could_ever_hold(self, num_tokens: int) -> bool:
        """Whether the whole pool is big enough for a request of this final size (engines refuse
        one that is not, even for a prefill they would hand off)."""
        return blocks_for(num_tokens, self.block_size) <= self.kv_blocks_total


@dataclass(frozen=True)
class RoutedRequest:
    """A request the router is relaying."""

    request_id: str
    engine: str  # name of the engine holding it now
    num_prompt_tokens: int
    num_generated_tokens: int
    max_tokens: int
    migrating: bool = False
    num_migrations: int = 0  # moves so far, the hand-off after the GPU prefill included

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated_tokens

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.num_generated_tokens)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks holding num_tokens tokens (ceil division; 0 for no tokens)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens <= 0:
        return 0
    return -(-num_tokens // block_size)


def estimated_blocks_used(engine: EngineView, requests: Iterable[RoutedRequest]) -> int:
    """KV blocks in use on `engine`: the larger of its snapshot and the current footprint of
    the requests the router knows it holds (snapshots lag behind fresh admissions)."""
    own = sum(blocks_for(r.num_tokens, engine.block_size) for r in requests if r.engine == engine.name)
    return max(engine.kv_blocks_used, own)


def count_held(engine: EngineView, requests: Iterable[RoutedRequest]) -> int:
    """Running requests on `engine`: the larger of its snapshot and the router's own count."""
    own = sum(1 for r in requests if r.engine == engine.name)
    return max(engine.num_running, own)


class LatencyPredictor(Protocol):
    """What admission and the migration planner ask a profile's cost model
    (dualpace.profile.cost_model.CostModel implements it); plain numbers in and out."""

    def itl_ms(self, kind: str, context_tokens: Sequence[int]) -> float:
        """Predicted ITL of an engine of `kind` ("gpu" | "cpu") decoding sequences of these contexts."""
        ...

    def kv_transfer_ms(self, num_tokens: int) -> float:
        """Predicted time to move num_tokens tokens of KV between the engines."""
        ...


def held_contexts(engine: EngineView, requests: Iterable[RoutedRequest]) -> list[int]:
    """Context lengths (tokens) of the requests `engine` holds, as far as the router knows:
    its own relayed requests, padded with their mean (or 0) up to the snapshot's running
    count when the engine runs requests the router does not relay (e.g. after a restart)."""
    contexts = [r.num_tokens for r in requests if r.engine == engine.name]
    missing = engine.num_running - len(contexts)
    if missing > 0:
        fill = sum(contexts) // len(contexts) if contexts else 0
        contexts.extend([fill] * missing)
    return contexts
