"""The layout of one GPU engine step that carries remote rows.

Pure (no torch, grpc, asyncio or clock): the runner passes in its own rows, the joins on offer and
per-layer costs (measured, kept by LayerTimes; or from a profile, built by
dualpace.profile.cost_model.layer_costs*), and gets back how to run the step.

A joined step runs two sub-batches per layer:

- S1 = D1 (some of the GPU's own decode rows) + R (the remote rows of every join): one dense pass
  over both, split around the attention (pre(S1) before it, post(S1) after it);
- S0 = the GPU's prefill tokens + the other own decodes D0: a whole layer on the GPU, run while the
  CPU attends R.

Per layer `t = pre(S1) + max(layer(S0) + attend(D1), cpu_layer(R)) + post(S1)`; pre + post is one
dense pass over S1's rows, so only their sum enters. The GPU waits `cpu_layer(R) - (layer(S0) +
attend(D1))` when that is positive. S0 empty is JOINED (one weight read per layer for both
engines), otherwise SPLIT (NEO's asymmetric pipelining). STAGED is today's path: the remote rows'
own dense pass at the step's layer boundaries, `dense(R)` more GPU time per layer, no wait.

All times are milliseconds per layer unless a name says otherwise (`_step_ms`: the whole step).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from dualpace.policy.policies import Policy, parse_policy, traits

LAYER_TIMES_EMA_WEIGHT = 0.2  # weight of a new per-layer measurement in LayerTimes


class JoinHow(str, enum.Enum):
    JOINED = "joined"  # S0 empty: the remote rows share every dense pass with the GPU's own rows
    SPLIT = "split"  # S0 non-empty: asymmetric pipelining, S0's layer covers the CPU's attention
    STAGED = "staged"  # declined: the remote rows run their own dense stages between the step's layers


@dataclass(frozen=True)
class OwnRows:
    """The GPU engine's own rows in this step."""

    num_prefill_tokens: int = 0
    decode_context_tokens: Sequence[int] = ()  # one entry per own decode row: its KV tokens read

    def __post_init__(self) -> None:
        if self.num_prefill_tokens < 0 or any(c < 0 for c in self.decode_context_tokens):
            raise ValueError("OwnRows: prefill tokens and decode contexts must be >= 0")


@dataclass(frozen=True)
class RemoteJoin:
    """One assisted CPU iteration offered to the step: its decode rows and its measured attention +
    ring time per layer (AssistBegin.expected_layer_us, in ms here)."""

    num_rows: int
    expected_layer_ms: float

    def __post_init__(self) -> None:
        if self.num_rows < 1 or not self.expected_layer_ms >= 0:
            raise ValueError(f"RemoteJoin needs num_rows >= 1 and expected_layer_ms >= 0, got "
                             f"{self.num_rows}, {self.expected_layer_ms}")


@dataclass(frozen=True)
class LayerCosts:
    """The GPU's per-layer costs. `dense_layer_ms[i]`: one layer's dense stages (QKV, O, MLP, and
    an even share of the LM head) over `dense_rows[i]` rows (decode rows or prefill tokens);
    piecewise linear between points, linear past the ends, never below 0. Attention of one layer:
    `attention_layer_ms_per_kv_token` x the KV tokens read. Build through
    dualpace.profile.cost_model.layer_costs, the one constructor."""

    num_layers: int
    dense_rows: tuple[int, ...]
    dense_layer_ms: tuple[float, ...]
    attention_layer_ms_per_kv_token: float

    def __post_init__(self) -> None:
        rows, ms = self.dense_rows, self.dense_layer_ms
        if self.num_layers < 1 or not rows or len(rows) != len(ms):
            raise ValueError("LayerCosts needs num_layers >= 1 and one dense_layer_ms per dense_rows point")
        if any(b <= a for a, b in zip(rows, rows[1:])) or rows[0] < 1:
            raise ValueError(f"LayerCosts.dense_rows must be >= 1 and strictly increasing, got {rows}")
        if any(not v >= 0 for v in ms) or not self.attention_layer_ms_per_kv_token >= 0:
            raise ValueError("LayerCosts: times must be finite and >= 0")

    def dense_ms(self, num_rows: int) -> float:
        """One layer's dense pass over num_rows rows (0 rows: no pass)."""
        if num_rows <= 0:
            return 0.0
        rows, ms = self.dense_rows, self.dense_layer_ms
        if len(rows) == 1:
            return ms[0]
        i = min(max(bisect.bisect_right(rows, num_rows) - 1, 0), len(rows) - 2)
        slope = (ms[i + 1] - ms[i]) / (rows[i + 1] - rows[i])
        return max(0.0, ms[i] + slope * (num_rows - rows[i]))

    def attention_ms(self, context_tokens: Sequence[int]) -> float:
        """One layer's decode attention over these rows' contexts."""
        return self.attention_layer_ms_per_kv_token * sum(context_tokens)


@dataclass(frozen=True)
class CooperativeLayout:
    """How to run the step. d1_rows: how many own decodes (the longest contexts) go into S1 with
    the remote rows; predicted_gpu_wait_ms: the whole step's wait for the CPU's attention."""

    how: JoinHow
    d1_rows: int
    predicted_layer_ms: float
    predicted_gpu_wait_ms: float


def own_step_layer_ms(own: OwnRows, costs: LayerCosts) -> float:
    """One layer of the step without remote rows (one sub-batch)."""
    num_decodes = len(own.decode_context_tokens)
    return costs.dense_ms(own.num_prefill_tokens + num_decodes) + costs.attention_ms(own.decode_context_tokens)


def plan_layout(policy: Policy | str, own: OwnRows, joins: Sequence[RemoteJoin],
                costs: LayerCosts) -> CooperativeLayout:
    """The step's layout: a 1-D scan over how many own decodes (longest context first) join S1.
    gated (CPU decodes only inside GPU steps, as NEO): the least GPU wait, ties by the shortest
    layer, never staged; dualpace: the shortest layer, or STAGED when the remote rows' own dense
    pass lengthens the step less."""
    chosen = traits(policy)
    if not chosen.uses_cpu_engine:
        raise ValueError(f"plan_layout needs a policy with a CPU engine, got {parse_policy(policy).value!r}")
    if not joins:
        raise ValueError("plan_layout needs at least one join")
    num_remote = sum(j.num_rows for j in joins)
    cpu_layer_ms = max(j.expected_layer_ms for j in joins)  # the joins attend in parallel, each on its CPU
    contexts = sorted(own.decode_context_tokens, reverse=True)
    candidates = []
    for d1_rows in range(len(contexts) + 1):
        d1, d0 = contexts[:d1_rows], contexts[d1_rows:]
        s0_empty = own.num_prefill_tokens == 0 and not d0
        s0_layer_ms = 0.0 if s0_empty else costs.dense_ms(own.num_prefill_tokens + len(d0)) + costs.attention_ms(d0)
        covered_ms = s0_layer_ms + costs.attention_ms(d1)
        layer_ms = costs.dense_ms(d1_rows + num_remote) + max(covered_ms, cpu_layer_ms)
        wait_ms = max(0.0, cpu_layer_ms - covered_ms)
        how = JoinHow.JOINED if s0_empty else JoinHow.SPLIT
        candidates.append(CooperativeLayout(how, d1_rows, layer_ms, wait_ms * costs.num_layers))
    if chosen.cpu_decodes_inside_gpu_steps:
        return min(candidates, key=lambda c: (_tie(c.predicted_gpu_wait_ms), _tie(c.predicted_layer_ms)))
    best = min(candidates, key=lambda c: (_tie(c.predicted_layer_ms), _tie(c.predicted_gpu_wait_ms)))
    staged_layer_ms = own_step_layer_ms(own, costs) + costs.dense_ms(num_remote)
    if staged_layer_ms < best.predicted_layer_ms:
        return CooperativeLayout(JoinHow.STAGED, 0, staged_layer_ms, 0.0)
    return best


def _tie(ms: float) -> float:
    """Times equal to a nanosecond are ties (sums in another order differ in the last bits); the
    scan's first such layout, the fewest own rows in S1, is kept."""
    return round(ms, 6)


def join_wait_bound_ms(expected_layer_us: float, min_ms: float) -> float:
    """How long the step waits for a join's attention of one layer before it drops the join."""
    if not (expected_layer_us >= 0 and min_ms >= 0):
        raise ValueError("expected_layer_us and min_ms must be >= 0")
    return max(min_ms, 2.0 * expected_layer_us / 1000.0)


def _row_bucket(num_rows: int) -> int:
    bucket = 1
    while bucket < num_rows:
        bucket *= 2
    return bucket


@dataclass
class LayerTimes:
    """The runner's measured per-layer GPU times, as EMAs: dense per row bucket (powers of two)
    and attention per KV token. It is given times; it never reads a clock."""

    dense_layer_ms_by_rows: dict[int, float] = field(default_factory=dict)
    attention_layer_ms_per_kv_token: float | None = None

    def record_dense(self, num_rows: int, layer_ms: float) -> None:
        if num_rows < 1 or not layer_ms >= 0:
            return  # nothing to learn from an empty pass or a bad reading
        bucket = _row_bucket(num_rows)
        previous = self.dense_layer_ms_by_rows.get(bucket)
        self.dense_layer_ms_by_rows[bucket] = _ema(previous, layer_ms)

    def record_attention(self, num_kv_tokens: int, layer_ms: float) -> None:
        if num_kv_tokens < 1 or not layer_ms >= 0:
            return
        self.attention_layer_ms_per_kv_token = _ema(self.attention_layer_ms_per_kv_token, layer_ms / num_kv_tokens)


def _ema(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - LAYER_TIMES_EMA_WEIGHT) * previous + LAYER_TIMES_EMA_WEIGHT * value
