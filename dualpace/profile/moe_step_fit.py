"""A mixture-of-experts CPU step's time as a fit over a profile's batch grid (pure: no torch).

A MoE step of B rows reads each selected expert once, whatever the number of rows routed to it
(MoeWeightBytes.step_bytes: the dense weights and the expected distinct experts of B rows), and
computes a product per row and expert choice. Its time is fitted as

    ms(B) = const + per_byte * step_bytes(B) + per_row * B

by least squares over the grid's measured points, each point's error relative to its time (a
weighted fit). The bytes alone overpredict batched steps (the rows of a batch share experts and
each expert's rows share its reads), the rows alone miss the steep growth of small batches;
together they fit both ends. Columns that the grid cannot tell
apart are left out in that order of preference: two grid points fit the line along the bytes, and
a grid where every expert is selected anyway (the bytes stop growing) fits the line along the rows.
A negative cost per byte or per row (times measured under load) drops that column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dualpace.model.moe_spec import MoeWeightBytes

_DEPENDENT = 1e-9  # a column whose part independent of the earlier ones is this small (relative) is left out


@dataclass(frozen=True)
class MoeStepFit:
    moe: MoeWeightBytes
    const_ms: float
    ms_per_byte: float
    ms_per_row: float

    @classmethod
    def fit(cls, moe: MoeWeightBytes, batch_grid: Sequence[float], ms: Sequence[float]) -> MoeStepFit:
        # each point weighted by 1 / its time: the fit minimises the relative error, so batch 1's
        # few milliseconds count as much as the largest batch's hundreds
        scale = [1.0 / t if t > 0 else 1.0 for t in ms]
        columns = [scale, [moe.step_bytes(b) * w for b, w in zip(batch_grid, scale)],
                   [b * w for b, w in zip(batch_grid, scale)]]
        y = [t * w for t, w in zip(ms, scale)]
        const, per_byte, per_row = least_squares(columns, y)
        if per_byte < 0 or per_row < 0:  # noisy times: neither reading bytes nor a row makes a step faster
            columns[1 if per_byte < per_row else 2] = [0.0] * len(y)
            const, per_byte, per_row = least_squares(columns, y)
        return cls(moe, const, max(0.0, per_byte), max(0.0, per_row))

    def ms(self, batch: float) -> float:
        """The fitted step time of `batch` rows, clamped at 0."""
        return max(0.0, self.const_ms + self.ms_per_byte * self.moe.step_bytes(batch) + self.ms_per_row * batch)


def _dot(u: Sequence[float], v: Sequence[float]) -> float:
    return sum(a * b for a, b in zip(u, v))


def least_squares(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Coefficients c minimising |sum_j c[j] columns[j] - y|^2 (modified Gram-Schmidt); a column
    (nearly) dependent on the earlier ones, or beyond the number of points, gets 0."""
    basis: list[list[float]] = []  # orthonormal
    kept: list[int] = []
    # r[i][j]: column j's coordinate along basis vector i, for the back substitution
    r: list[dict[int, float]] = []
    for j, column in enumerate(columns):
        v = list(column)
        norm0 = _dot(v, v) ** 0.5
        coords = []
        for q in basis:
            c = _dot(q, v)
            coords.append(c)
            v = [a - c * b for a, b in zip(v, q)]
        norm = _dot(v, v) ** 0.5
        if norm0 == 0.0 or norm <= _DEPENDENT * norm0:
            continue
        for i, c in enumerate(coords):
            r[i][j] = c
        r.append({j: norm})
        basis.append([a / norm for a in v])
        kept.append(j)
    along = [_dot(q, y) for q in basis]  # y's coordinates in the basis
    coefficients = [0.0] * len(columns)
    for i in reversed(range(len(kept))):
        rest = sum(r[i][j] * coefficients[j] for j in kept[i + 1:])
        coefficients[kept[i]] = (along[i] - rest) / r[i][kept[i]]
    return coefficients
