"""A node's load, from its router's ListPlacements (the engines' load snapshots), in the terms
Dynamo's router and planner read, and under the names llm-d's endpoint picker scrapes.

Pure. Two KV tiers: the GPU engine's pool (where every request is admitted and prefilled first)
and the CPU engine's host pool. Dynamo's KV-aware router counts blocks of one pool per worker,
so it gets the GPU tier; the host tier is reported beside it under dualpace_ names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierLoad:
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int

    @property
    def usage_ratio(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class NodeLoad:
    num_running: int  # requests in the engines' step loops
    num_waiting: int  # requests waiting to be scheduled in an engine
    gpu: TierLoad | None  # None: no healthy GPU engine
    host: TierLoad | None  # None: no healthy CPU engine (e.g. policy gpu-only)

    @property
    def num_active(self) -> int:
        return self.num_running + self.num_waiting


def node_load(placements: dict) -> NodeLoad:
    """From placements_to_dict(ListPlacements): healthy engines only."""
    tiers: dict[str, TierLoad] = {}
    running = waiting = 0
    for engine in placements["engines"]:
        if not engine["healthy"]:
            continue
        running += engine["running"]
        waiting += engine["waiting"]
        tier = TierLoad(engine["kv_blocks_used"], engine["kv_blocks_total"], engine.get("block_size", 0))
        previous = tiers.get(engine["kind"])
        if previous is not None:  # several engines of one kind: add their pools up
            tier = TierLoad(previous.kv_blocks_used + tier.kv_blocks_used,
                            previous.kv_blocks_total + tier.kv_blocks_total, previous.block_size or tier.block_size)
        tiers[engine["kind"]] = tier
    return NodeLoad(running, waiting, tiers.get("gpu"), tiers.get("cpu"))


def kv_block_size(placements: dict) -> int | None:
    """The block size of the node's GPU engine (prefills run there), else of any engine."""
    sizes = {e["kind"]: e.get("block_size", 0) for e in placements["engines"] if e.get("block_size")}
    return sizes.get("gpu") or next(iter(sizes.values()), None)


def llm_d_gauges(load: NodeLoad) -> dict[str, float]:
    """The vLLM-named gauges llm-d's endpoint picker scrapes. kv_cache_usage_perc is the GPU tier,
    as a fraction in [0, 1] like vLLM's."""
    return {
        "vllm:num_requests_running": float(load.num_running),
        "vllm:num_requests_waiting": float(load.num_waiting),
        "vllm:kv_cache_usage_perc": load.gpu.usage_ratio if load.gpu is not None else 0.0,
    }
