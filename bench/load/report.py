"""Sweep reports: rows per rate, interpolation at equal P99 ITL, markdown tables and plots.

The interpolation helpers are pure; plotting imports matplotlib lazily and reports failure
instead of raising (the JSON is written first either way).
"""

from __future__ import annotations

import math
import textwrap
from itertools import pairwise


def sweep_row(rate: float, summary: dict) -> dict:
    """The compact per-rate line of a sweep (the full summary stays in the JSON beside it)."""
    return {
        "rate_rps": rate,
        "request_throughput_rps": summary["request_throughput_rps"],
        "output_token_throughput_tps": summary["output_token_throughput_tps"],
        "goodput_rps": summary["goodput_rps"],
        "ttft_p50_ms": summary["ttft"]["p50_ms"],
        "ttft_p99_ms": summary["ttft"]["p99_ms"],
        "itl_p50_ms": summary["itl"]["p50_ms"],
        "itl_p99_ms": summary["itl"]["p99_ms"],
        "tpot_mean_ms": summary["tpot"]["mean_ms"],
        "e2e_p99_ms": summary["e2e"]["p99_ms"],
        "completed": summary["accounting"]["completed"],
        "failed": summary["accounting"]["failed"],
    }


def _points(rows: list[dict], y_key: str) -> list[tuple[float, float]]:
    """(P99 ITL, y) for rows that have both, in rate order."""
    return [(r["itl_p99_ms"], r[y_key]) for r in rows if r.get("itl_p99_ms") is not None and r.get(y_key) is not None]


def value_at_itl(rows: list[dict], itl_ms: float, y_key: str) -> tuple[float | None, str]:
    """y (e.g. throughput, or rate) at P99 ITL = itl_ms, interpolated linearly along the rate
    sweep between the last row at or under the target and the first row above it.
    Returns (value, how): how is "interpolated", "measured", "all under target" (the largest
    measured value: the sweep did not reach the target) or "never under target" (None). Leading
    rates over the target followed by ones under it (a fresh system's first rate, say) are left
    out, and how says so (it used to say "never under target" then)."""
    points = _points(sorted(rows, key=lambda r: r["rate_rps"]), y_key)
    first_under = next((i for i, (x, _) in enumerate(points) if x <= itl_ms), None)
    if first_under is None:
        return None, "never under target"
    value, how = _along(points[first_under:], itl_ms)
    return value, how if first_under == 0 else f"{how}; lowest {first_under} rate(s) over it, left out"


def _along(points: list[tuple[float, float]], itl_ms: float) -> tuple[float | None, str]:
    """value_at_itl over points whose first is at or under the target."""
    best_under = None
    for (x0, y0), (x1, y1) in pairwise(points):
        if x0 <= itl_ms:
            best_under = y0
        if x0 <= itl_ms < x1:
            return y0 + (y1 - y0) * (itl_ms - x0) / (x1 - x0), "interpolated"
    if points[-1][0] <= itl_ms:
        return max(y for x, y in points if x <= itl_ms), "all under target"
    return best_under, "measured"


def highest_rate_meeting(rows: list[dict], itl_ms: float) -> float | None:
    """The highest swept rate whose P99 ITL is within itl_ms and that had no failures."""
    ok = [r["rate_rps"] for r in rows
          if r.get("itl_p99_ms") is not None and r["itl_p99_ms"] <= itl_ms and not r.get("failed")]
    return max(ok) if ok else None


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def comparison_table(results: dict[str, list[dict]], itl_target_ms: float) -> str:
    """Markdown: per policy, throughput at P99 ITL = target and the highest rate meeting it."""
    lines = [
        (f"| policy | req/s at P99 ITL = {itl_target_ms:g} ms | tok/s at P99 ITL = {itl_target_ms:g} ms "
         f"| rate at P99 ITL = {itl_target_ms:g} ms (interp.) | highest swept rate meeting it |"),
        "|---|---|---|---|---|",
    ]
    for policy, rows in results.items():
        rps, how = value_at_itl(rows, itl_target_ms, "request_throughput_rps")
        tps, _ = value_at_itl(rows, itl_target_ms, "output_token_throughput_tps")
        rate, _ = value_at_itl(rows, itl_target_ms, "rate_rps")
        note = "" if how in ("interpolated", "measured") else f" ({how})"
        lines.append(f"| {policy} | {_fmt(rps, 3)}{note} | {_fmt(tps, 1)}{note} | {_fmt(rate, 3)}{note} "
                     f"| {_fmt(highest_rate_meeting(rows, itl_target_ms), 3)} |")
    return "\n".join(lines)


def sweep_table(results: dict[str, list[dict]]) -> str:
    """Markdown: every measured point (with a preemptions column when the rows carry the engines' count)."""
    preempt = any("num_preemptions" in r for rows in results.values() for r in rows)
    lines = [("| policy | rate req/s | done/failed | req/s | out tok/s | TTFT P50 / P99 ms | ITL P50 / P99 ms "
              "| TPOT mean ms | E2E P99 ms |" + (" preemptions |" if preempt else "")),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if preempt else "")]
    for policy, rows in results.items():
        for r in rows:
            lines.append(f"| {policy} | {_fmt(r['rate_rps'])} | {r['completed']}/{r['failed']} "
                         f"| {_fmt(r['request_throughput_rps'], 3)} | {_fmt(r['output_token_throughput_tps'], 1)} "
                         f"| {_fmt(r['ttft_p50_ms'], 0)} / {_fmt(r['ttft_p99_ms'], 0)} "
                         f"| {_fmt(r['itl_p50_ms'], 1)} / {_fmt(r['itl_p99_ms'], 1)} "
                         f"| {_fmt(r['tpot_mean_ms'], 1)} | {_fmt(r['e2e_p99_ms'], 0)} |"
                         + (f" {_fmt(r.get('num_preemptions'), 0)} |" if preempt else ""))
    return "\n".join(lines)


def plot_throughput_vs_itl(results: dict[str, list[dict]], path: str, title: str,
                           itl_target_ms: float | None = None) -> str | None:
    """One line per series: output token throughput (x) vs P99 ITL (y), points labelled with the
    rate. Returns None when written, else why it could not be drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - any import failure means no plot, not no report
        return f"matplotlib unavailable: {exc}"
    try:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, rows in results.items():
            pts = [(r["output_token_throughput_tps"], r["itl_p99_ms"], r["rate_rps"])
                   for r in rows if r.get("itl_p99_ms") is not None]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            for x, y, rate in pts:
                ax.annotate(f"{rate:g}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if itl_target_ms is not None:
            ax.axhline(itl_target_ms, color="grey", linestyle="--", linewidth=0.8,
                       label=f"P99 ITL target {itl_target_ms:g} ms")
        ax.set_xlabel("output token throughput (tokens/s)")
        ax.set_ylabel("P99 inter-token latency (ms)")
        ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    except Exception as exc:  # noqa: BLE001
        return f"plot failed: {exc}"
    return None
