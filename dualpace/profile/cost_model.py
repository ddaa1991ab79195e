"""The cost model: predicted iteration latencies from a profile's tables (docs/profiles.md).

Pure: no torch, grpc, asyncio or clock. Router, cpu_service and the simulator use it.

Interpolation: piecewise linear in 1-D, bilinear in 2-D. Outside a grid the value is
extrapolated linearly from the nearest segment (the first or last two grid points), so a
batch twice the largest profiled one costs about what the trend says rather than the
same as the largest; results are clamped at 0 (extrapolating below the first point must
not give a negative latency). A grid of a single point gives a constant.

Composition of an iteration (documented approximations):

- GPU iteration with P prefill tokens and a decode batch of B sequences of mean context C:
  decode only: gpu_decode_ms(B, C); prefill only: gpu_prefill_ms(P); mixed: the dense work
  is shared, so max(gpu_prefill_ms(P + B), gpu_decode_ms(B, C0)) plus the decode attention
  on top, gpu_decode_ms(B, C) - gpu_decode_ms(B, C0), where C0 is the first context point.
  The attention of a prefill chunk over earlier context is not modelled.
- CPU Local decode iteration: cpu_dense_ms(B) + cpu_attention_ms(B, C) + lm_head_sampling_ms(B).
  For a mixture-of-experts model cpu_dense_ms is the least-squares fit over the grid of
  const + a * bytes read + b * rows (the expected bytes of B rows: dense weights once, each
  selected expert once, model.moe in the profile; dualpace.profile.moe_step_fit).
- CPU Assisted decode iteration: assist_ms(B) + cpu_attention_ms(B, C) (the attention runs
  between the per-layer round trips, so the two add up).
- CPU iteration with prefill tokens (a recompute after preemption): Local only,
  cpu_dense_ms(P + B) + the decodes' attention + lm_head_sampling_ms(sequences sampling).
- KV transfer of N tokens: fixed_ms + N * bytes_per_token / bytes_per_s.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dualpace.policy.cooperative_plan import LayerCosts, LayerTimes
from dualpace.policy.mode_choice import ExecutionMode, predicted_latencies
from dualpace.profile.moe_step_fit import MoeStepFit
from dualpace.profile.schema import Profile, Table1D, Table2D


def _segment(grid: Sequence[float], x: float) -> tuple[int, float]:
    """(i, t): x = grid[i] + t * (grid[i+1] - grid[i]); t outside [0, 1] off the ends."""
    if len(grid) == 1:
        return 0, 0.0
    i = bisect.bisect_right(grid, x) - 1
    i = min(max(i, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def interp1d(grid: Sequence[float], values: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation off the ends, clamped at 0."""
    if len(grid) == 1:
        return max(0.0, values[0])
    i, t = _segment(grid, x)
    return max(0.0, values[i] + t * (values[i + 1] - values[i]))


def interp2d(grid0: Sequence[float], grid1: Sequence[float], values: Sequence[Sequence[float]],
             x0: float, x1: float) -> float:
    """Bilinear interpolation (values[i][j] at grid0[i], grid1[j]); linear extrapolation
    off the ends along each axis, clamped at 0."""
    def along1(row: Sequence[float]) -> float:
        if len(grid1) == 1:
            return row[0]
        j, u = _segment(grid1, x1)
        return row[j] + u * (row[j + 1] - row[j])

    if len(grid0) == 1:
        return max(0.0, along1(values[0]))
    i, t = _segment(grid0, x0)
    low, high = along1(values[i]), along1(values[i + 1])
    return max(0.0, low + t * (high - low))


@dataclass(frozen=True)
class DecodeBatch:
    """A decode batch: number of sequences and their mean context (KV tokens read each)."""

    batch: int
    mean_context_tokens: float

    @classmethod
    def of(cls, context_tokens: Sequence[int]) -> DecodeBatch:
        if not context_tokens:
            return cls(0, 0.0)
        return cls(len(context_tokens), sum(context_tokens) / len(context_tokens))


@dataclass(frozen=True)
class CpuIterationCost:
    local_ms: float
    assisted_ms: float | None  # None when the iteration cannot be assisted (it has prefill tokens)

    @property
    def best_ms(self) -> float:
        return self.local_ms if self.assisted_ms is None else min(self.local_ms, self.assisted_ms)

    @property
    def assisted_is_faster(self) -> bool:
        return self.assisted_ms is not None and self.assisted_ms < self.local_ms


class CostModel:
    """Predictions from one profile. `assist_available`: whether the CPU engine can run
    Assisted iterations (a gpu_service is configured); when not, CPU ITLs are Local ones."""

    def __init__(self, profile: Profile, assist_available: bool = True):
        self.profile = profile
        self.assist_available = assist_available
        self.kv_bytes_per_token = profile.capacities.bytes_per_block / profile.model.block_size
        moe, table = profile.model.moe, profile.tables.get("cpu_dense_ms")
        self.moe_step_fit = None if moe is None or table is None else MoeStepFit.fit(moe, table.grid, table.ms)

    # -------------------------------------------------------------- raw tables

    def _t1(self, name: str, x: float) -> float:
        table: Table1D = self.profile.table1d(name)
        return interp1d(table.grid, table.ms, x)

    def _t2(self, name: str, x0: float, x1: float) -> float:
        table: Table2D = self.profile.table2d(name)
        return interp2d(table.grid0, table.grid1, table.ms, x0, x1)

    def gpu_prefill_ms(self, num_tokens: int) -> float:
        return self._t1("gpu_prefill_ms", num_tokens) if num_tokens > 0 else 0.0

    def cpu_prefill_ms(self, num_tokens: int) -> float:
        """Prefilling num_tokens tokens alone on the CPU engine (a Local iteration, one sampled)."""
        if num_tokens <= 0:
            return 0.0
        return self.cpu_dense_ms(num_tokens) + self.lm_head_sampling_ms(1)

    def gpu_decode_ms(self, batch: int, mean_context_tokens: float) -> float:
        return self._t2("gpu_decode_ms", batch, mean_context_tokens) if batch > 0 else 0.0

    def cpu_dense_ms(self, batch: int) -> float:
        """The dense stages of a CPU step over `batch` tokens. For a mixture-of-experts model the
        grid's times are fitted as const + a * bytes read + b * rows (MoeStepFit): the step reads
        each expert its rows select once (expected distinct experts of a batch), which grows
        steeply over small batches and flattens once most experts are selected."""
        if batch <= 0:
            return 0.0
        if self.moe_step_fit is not None:
            return self.moe_step_fit.ms(batch)
        return self._t1("cpu_dense_ms", batch)

    def cpu_attention_ms(self, batch: int, mean_context_tokens: float) -> float:
        return self._t2("cpu_attention_ms", batch, mean_context_tokens) if batch > 0 else 0.0

    def assist_ms(self, batch: int) -> float:
        return self._t1("assist_ms", batch) if batch > 0 else 0.0

    def lm_head_sampling_ms(self, batch: int) -> float:
        return self._t1("lm_head_sampling_ms", batch) if batch > 0 else 0.0

    # -------------------------------------------------------------- predictions

    def gpu_iteration_ms(self, num_prefill_tokens: int, decode: DecodeBatch) -> float:
        """One GPU engine iteration: prefill tokens plus a decode batch (see the module doc)."""
        if decode.batch == 0:
            return self.gpu_prefill_ms(num_prefill_tokens)
        decode_ms = self.gpu_decode_ms(decode.batch, decode.mean_context_tokens)
        if num_prefill_tokens == 0:
            return decode_ms
        first_context = self.profile.table2d("gpu_decode_ms").grid1[0]
        base_ms = self.gpu_decode_ms(decode.batch, first_context)
        dense_ms = max(self.gpu_prefill_ms(num_prefill_tokens + decode.batch), base_ms)
        return dense_ms + max(0.0, decode_ms - base_ms)

    def cpu_local_ms(self, decode: DecodeBatch, num_prefill_tokens: int = 0, num_sampled: int | None = None) -> float:
        """A Local CPU iteration (every stage on the CPU)."""
        sampled = decode.batch if num_sampled is None else num_sampled
        return (self.cpu_dense_ms(num_prefill_tokens + decode.batch)
                + self.cpu_attention_ms(decode.batch, decode.mean_context_tokens)
                + self.lm_head_sampling_ms(sampled))

    def cpu_assisted_ms(self, decode: DecodeBatch) -> float:
        """An Assisted CPU decode iteration (dense on the GPU, attention on the CPU)."""
        return self.assist_ms(decode.batch) + self.cpu_attention_ms(decode.batch, decode.mean_context_tokens)

    def cpu_iteration(self, decode: DecodeBatch, num_prefill_tokens: int = 0,
                      num_sampled: int | None = None) -> CpuIterationCost:
        """Both modes' predictions; an iteration with prefill tokens can only run Local."""
        local = self.cpu_local_ms(decode, num_prefill_tokens, num_sampled)
        if num_prefill_tokens > 0 or decode.batch == 0:
            return CpuIterationCost(local, None)
        return CpuIterationCost(local, self.cpu_assisted_ms(decode))

    def cpu_itl_with_one_more_ms(self, context_tokens: Sequence[int], new_context_tokens: int,
                                 assist_available: bool = True) -> float:
        """The CPU engine's predicted inter-token latency if one more request of
        `new_context_tokens` joined its decode batch (one token per iteration, so the ITL
        is the iteration latency; the faster mode when assist is available)."""
        decode = DecodeBatch.of([*context_tokens, new_context_tokens])
        cost = self.cpu_iteration(decode)
        return cost.best_ms if assist_available else cost.local_ms

    def itl_ms(self, kind: str, context_tokens: Sequence[int]) -> float:
        """Predicted inter-token latency of engine `kind` ("gpu" or "cpu") decoding a batch of
        sequences with these contexts (one token per sequence per iteration, so the ITL is
        the iteration latency). The router's admission and
        migration planner call this (dualpace.policy.views.LatencyPredictor)."""
        decode = DecodeBatch.of(context_tokens)
        if decode.batch == 0:
            return 0.0
        if kind == "gpu":
            return self.gpu_decode_ms(decode.batch, decode.mean_context_tokens)
        if kind == "cpu":
            cost = self.cpu_iteration(decode)
            return cost.best_ms if self.assist_available else cost.local_ms
        raise ValueError(f"engine kind must be 'gpu' or 'cpu', got {kind!r}")

    def kv_transfer_ms(self, num_tokens: int) -> float:
        """Moving num_tokens tokens of KV between the engines."""
        transfer = self.profile.kv_transfer
        num_bytes = max(0, num_tokens) * self.kv_bytes_per_token
        return transfer.fixed_ms + 1000.0 * num_bytes / transfer.bytes_per_s


def predicted_mode_latencies(cost: CostModel, max_batch_size: int, context_tokens: int,
                             assist_available: bool, cooperative: bool = False) -> dict[tuple[ExecutionMode, int], float]:
    """The CPU engine's mode choice seed (ModeChooser.seed): each mode's predicted iteration
    latency per batch bucket, at a mean context of `context_tokens` (cpu_service --profile and
    the simulator seed it the same way). Cooperative is seeded at the assisted prediction (a
    joined iteration on an idle GPU costs about that; measurements take over)."""
    def assisted(batch: int) -> float:
        return cost.cpu_assisted_ms(DecodeBatch(batch, float(context_tokens)))

    return predicted_latencies(
        lambda batch: cost.cpu_local_ms(DecodeBatch(batch, float(context_tokens))),
        assisted if assist_available else None, max_batch_size,
        assisted if assist_available and cooperative else None)


def layer_costs(num_layers: int, dense_layer_ms_by_rows: Mapping[int, float],
                attention_layer_ms_per_kv_token: float) -> LayerCosts:
    """The one constructor of the planner's per-layer costs (dualpace.policy.cooperative_plan):
    the simulator's from a profile (layer_costs_of_profile) and the runner's from its measured
    LayerTimes (layer_costs_measured) both come through here."""
    points = sorted((int(rows), float(ms)) for rows, ms in dense_layer_ms_by_rows.items() if rows >= 1)
    if not points:
        raise ValueError("layer_costs needs at least one dense point")
    return LayerCosts(num_layers, tuple(r for r, _ in points), tuple(ms for _, ms in points),
                      float(attention_layer_ms_per_kv_token))


def gpu_dense_iteration_ms(cost: CostModel, num_rows: int) -> float:
    """The GPU's dense work (every layer, LM head included) over num_rows decode rows or prefill
    tokens: the profile's gpu_dense_ms where it has one, else the larger of the decode table at its
    smallest context (its attention is negligible there) and the prefill table."""
    if num_rows <= 0:
        return 0.0
    if "gpu_dense_ms" in cost.profile.tables:
        return cost._t1("gpu_dense_ms", num_rows)
    first_context = cost.profile.table2d("gpu_decode_ms").grid1[0]
    return max(cost.gpu_decode_ms(num_rows, first_context), cost.gpu_prefill_ms(num_rows))


def layer_costs_of_profile(cost: CostModel) -> LayerCosts:
    """Per-layer costs from a profile's tables: dense from gpu_dense_iteration_ms on the union of
    the decode and prefill grids, divided evenly over the layers; attention per KV token fitted
    (least squares through 0) to the decode table's rise over its smallest context."""
    num_layers = cost.profile.model.num_layers
    decode = cost.profile.table2d("gpu_decode_ms")
    grid = sorted({int(x) for x in decode.grid0} | {int(x) for x in cost.profile.table1d("gpu_prefill_ms").grid})
    dense = {rows: gpu_dense_iteration_ms(cost, rows) / num_layers for rows in grid if rows >= 1}
    first_context = decode.grid1[0]
    sum_xy = sum_xx = 0.0
    for i, batch in enumerate(decode.grid0):
        for j, context in enumerate(decode.grid1):
            kv_tokens = batch * (context - first_context)
            sum_xy += kv_tokens * max(0.0, decode.ms[i][j] - decode.ms[i][0])
            sum_xx += kv_tokens * kv_tokens
    per_token_ms = sum_xy / sum_xx / num_layers if sum_xx > 0 else 0.0
    return layer_costs(num_layers, dense, per_token_ms)


def layer_costs_measured(times: LayerTimes, seed: LayerCosts | None) -> LayerCosts | None:
    """The runner's per-layer costs: its measured EMAs, each missing part from the seed (a
    profile's layer_costs_of_profile); None when neither has a dense point."""
    dense = dict(zip(seed.dense_rows, seed.dense_layer_ms)) if seed is not None else {}
    dense.update(times.dense_layer_ms_by_rows)
    attention = times.attention_layer_ms_per_kv_token
    if attention is None:
        attention = seed.attention_layer_ms_per_kv_token if seed is not None else 0.0
    if not dense:
        return None
    num_layers = seed.num_layers if seed is not None else 1
    return layer_costs(num_layers, dense, attention)


def cpu_join_layer_ms(cost: CostModel, decode: DecodeBatch) -> float:
    """A joined CPU iteration's attention + ring time per layer (what it sends as
    expected_layer_us): its attention over host KV and the part of assist_ms that is not the GPU's
    dense work (round trips, payload), spread over the layers."""
    num_layers = cost.profile.model.num_layers
    if "assist_round_trip_ms" in cost.profile.tables:
        ring_ms = cost._t1("assist_round_trip_ms", decode.batch)
    else:
        ring_ms = max(0.0, cost.assist_ms(decode.batch) - gpu_dense_iteration_ms(cost, decode.batch))
    return (cost.cpu_attention_ms(decode.batch, decode.mean_context_tokens) + ring_ms) / num_layers
