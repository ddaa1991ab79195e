"""A finished simulation, summarized: throughput, TTFT and ITL percentiles, engine counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dualpace.stats import percentile
from profiles.sim.config import CPU, GPU, SimResult
from profiles.sim.prefix import prefix_cache_counts

if TYPE_CHECKING:
    from profiles.sim.simulator import Simulator


def summarize(sim: Simulator, rate: float) -> SimResult:
    completed = [t for t in sim.tracks.values() if t.finish_ms is not None and t.token_times_ms]
    ttfts = [t.token_times_ms[0] - t.spec.arrival_s * 1000.0 for t in completed]
    itls = [b - a for t in completed for a, b in zip(t.token_times_ms, t.token_times_ms[1:])]
    tokens = sum(len(t.token_times_ms) for t in completed)
    start = min((t.spec.arrival_s * 1000.0 for t in sim.tracks.values()), default=0.0)
    end = max((t.finish_ms for t in completed), default=start)
    duration_s = max(1e-9, (end - start) / 1000.0)
    gpu, cpu = sim.engines[GPU], sim.engines.get(CPU)
    query_tokens, hit_tokens = prefix_cache_counts([e.scheduler for e in sim.engines.values()])

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    return SimResult(
        policy=sim.config.policy.value, rate=rate, num_requests=len(sim.tracks),
        requests_completed=len(completed), requests_rejected=sim.num_rejected, duration_s=duration_s,
        throughput_tokens_per_s=tokens / duration_s, requests_per_s=len(completed) / duration_s,
        p50_ttft_ms=pct(ttfts, 50), p99_ttft_ms=pct(ttfts, 99), p50_itl_ms=pct(itls, 50),
        p99_itl_ms=pct(itls, 99), mean_itl_ms=sum(itls) / len(itls) if itls else None,
        num_generated_tokens=tokens, num_handoffs=sim.num_handoffs, num_migrations=sim.num_migrations,
        num_moves_without_kv=sim.num_moves_without_kv,
        num_preemptions=sum(e.scheduler.num_preemptions for e in sim.engines.values()),
        gpu_iterations=gpu.num_iterations, cpu_iterations=cpu.num_iterations if cpu else 0,
        cpu_local_iterations=cpu.num_local if cpu else 0, cpu_assisted_iterations=cpu.num_assisted if cpu else 0,
        requests_touching_cpu=sum(1 for t in sim.tracks.values() if CPU in t.engines_seen),
        gpu_busy_fraction=min(1.0, gpu.busy_ms / 1000.0 / duration_s),
        cpu_busy_fraction=min(1.0, cpu.busy_ms / 1000.0 / duration_s) if cpu else 0.0,
        prefix_cache_hit_rate=hit_tokens / query_tokens if sim.config.prefix_caching and query_tokens else None,
        prefill_tokens_saved=hit_tokens,
        num_cooperative_choices=sim.num_cooperative_choices, num_joined_iterations=sim.num_joined_iterations,
        num_joined_layouts=sim.num_joined_iterations - sim.num_split_iterations,
        num_split_layouts=sim.num_split_iterations, num_joins_declined_to_staged=sim.num_joins_declined_to_staged,
        mean_join_wait_ms=sim.join_wait_ms_total / sim.num_joined_iterations if sim.num_joined_iterations else None,
        num_layers_shared=sim.num_layers_shared, num_gpu_engine_tokens=sim.num_gpu_engine_tokens,
    )


def join_summary(result: dict) -> str:
    """The cooperative counters of a SimResult.as_dict() in one phrase ("" when nothing asked to join)."""
    choices = result.get("num_cooperative_choices") or 0
    if not choices:
        return ""
    wait = result.get("mean_join_wait_ms")
    return (f", joins {result['num_joined_iterations']}/{choices} cooperative ({result['num_joined_layouts']} joined, "
            f"{result['num_split_layouts']} split; declined {result['num_joins_declined_to_staged']} to staged), mean wait "
            f"{'-' if wait is None else f'{wait:.1f}'} ms, {result['num_layers_shared']} layers shared")
