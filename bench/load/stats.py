"""Per-request timings -> the benchmark's statistics. Pure: no clock, no I/O.

Definitions (all times from the same monotonic clock, in seconds in, milliseconds out):
- TTFT: first message carrying tokens - the moment the request was sent;
- ITL: every inter-token gap; a message carrying k tokens after a gap g counts as k gaps of
  g / k (extra tokens in the first message add no gap: TTFT covers them);
- TPOT: per request, (E2E - TTFT) / (tokens - 1), for requests with at least two tokens;
- E2E: end of the stream - sent;
- a request is *completed* when its stream ended OK with a finish reason; anything else is
  *failed* under its gRPC code (DEADLINE_EXCEEDED: still running at the benchmark's timeout);
- prefix-cache hit rate: cached prompt tokens (usage.cached_tokens) / prompt tokens, over
  completed requests (tokens, as vLLM counts them);
- goodput: completed requests per second whose TTFT <= the TTFT SLO and whose own P99
  inter-token gap <= the ITL SLO (an SLO not given is not checked).
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dualpace.stats import percentile

OK = "OK"


@dataclass
class RequestRecord:
    """What the driver measured for one request (perf_counter seconds)."""

    index: int
    input_len: int
    output_len: int  # requested (max_tokens)
    scheduled_s: float  # when it was due
    sent_s: float | None = None  # when the call started (later than due under --max-concurrency)
    messages: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in it)
    end_s: float | None = None
    status: str | None = None  # "OK" or a gRPC status code name
    finish_reason: str | None = None
    detail: str = ""
    engines: list[str] = field(default_factory=list)
    tokens_by_engine: Counter = field(default_factory=Counter)  # tokens each engine sent (by its name)
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (the final usage)
    output_token_ids: list[int] = field(default_factory=list)  # what it generated (multi-turn history)

    @property
    def completed(self) -> bool:
        return self.status == OK and self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.messages)

    def ttft_s(self) -> float | None:
        for at, n in self.messages:
            if n > 0:
                return at - self.sent_s
        return None

    def itl_s(self) -> list[float]:
        gaps, last = [], None
        for at, n in self.messages:
            if n <= 0:
                continue
            if last is not None:
                gaps.extend([(at - last) / n] * n)
            last = at
        return gaps

    def e2e_s(self) -> float | None:
        return None if self.end_s is None or self.sent_s is None else self.end_s - self.sent_s

    def tpot_s(self) -> float | None:
        ttft, e2e, n = self.ttft_s(), self.e2e_s(), self.num_tokens
        if ttft is None or e2e is None or n < 2:
            return None
        return (e2e - ttft) / (n - 1)


def distribution_ms(values_s: list[float]) -> dict:
    """mean / p50 / p90 / p99 / max in ms, rounded to 0.01; all None without values."""
    if not values_s:
        return {"count": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None}
    ms = [v * 1e3 for v in values_s]
    return {
        "count": len(ms),
        "mean_ms": round(sum(ms) / len(ms), 2),
        "p50_ms": round(percentile(ms, 50), 2),
        "p90_ms": round(percentile(ms, 90), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
    }


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    if not record.completed:
        return False
    if slo_ttft_ms is not None:
        ttft = record.ttft_s()
        if ttft is None or ttft * 1e3 > slo_ttft_ms:
            return False
    if slo_itl_ms is not None:
        gaps = record.itl_s()
        if gaps and percentile(gaps, 99) * 1e3 > slo_itl_ms:
            return False
    return True


class AccountingError(AssertionError):
    """A request neither completed nor failed: the driver lost it."""


def summarize(records: list[RequestRecord], num_requests: int, duration_s: float,
              slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None) -> dict:
    """The report for one run. num_requests: how many were planned (some may not have been sent
    before the timeout); duration_s: first send to last end (the throughput denominator)."""
    sent = [r for r in records if r.sent_s is not None]
    completed = [r for r in sent if r.completed]
    failed = [r for r in sent if not r.completed]
    unsent = num_requests - len(sent)
    # Every sent request has a final status; none lost.
    if any(r.status is None for r in sent) or len(sent) != len(completed) + len(failed) or unsent < 0:
        raise AccountingError(f"sent {len(sent)} != completed {len(completed)} + failed {len(failed)} "
                              f"(or a request without a final status)")
    failures = Counter(r.status if r.status != OK else "NO_FINISH_REASON" for r in failed)
    duration_s = max(duration_s, 1e-9)
    output_tokens = sum(r.num_tokens for r in completed)
    input_tokens = sum(r.input_len for r in completed)
    good = [r for r in completed if meets_slo(r, slo_ttft_ms, slo_itl_ms)]
    return {
        "accounting": {
            "planned": num_requests,
            "sent": len(sent),
            "completed": len(completed),
            "failed": len(failed),
            "not_sent": unsent,
            "line": f"sent {len(sent)} = completed {len(completed)} + failed {len(failed)}"
                    f" (planned {num_requests}, not sent before the timeout {unsent})",
        },
        "duration_s": round(duration_s, 3),
        "request_throughput_rps": round(len(completed) / duration_s, 4),
        "output_token_throughput_tps": round(output_tokens / duration_s, 2),
        "total_token_throughput_tps": round((input_tokens + output_tokens) / duration_s, 2),
        "goodput_rps": round(len(good) / duration_s, 4),
        "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms, "requests_meeting": len(good)},
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_prompt_tokens": (cached := sum(r.num_cached_tokens for r in completed)),
        "prefix_cache_hit_rate": round(cached / input_tokens, 4) if input_tokens else None,
        "short_outputs": sum(1 for r in completed if r.num_tokens < r.output_len),
        "ttft": distribution_ms([t for r in completed if (t := r.ttft_s()) is not None]),
        "itl": distribution_ms([g for r in completed for g in r.itl_s()]),
        "tpot": distribution_ms([t for r in completed if (t := r.tpot_s()) is not None]),
        "e2e": distribution_ms([t for r in completed if (t := r.e2e_s()) is not None]),
        "failures": dict(sorted(failures.items())),
        "engines": dict(sorted(Counter(" -> ".join(r.engines) or "-" for r in completed).items())),
        "tokens_by_engine": dict(sorted(sum((r.tokens_by_engine for r in completed), Counter()).items())),
    }


def request_rows(records: list[RequestRecord]) -> list[dict]:
    """Per-request detail for the JSON report (ms, rounded)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 2)

    t0 = min((r.scheduled_s for r in records), default=0.0)
    return [{
        "index": r.index,
        "input_len": r.input_len,
        "output_len": r.output_len,
        "due_s": round(r.scheduled_s - t0, 4),
        "queued_ms": ms(None if r.sent_s is None else r.sent_s - r.scheduled_s),
        "status": r.status if r.sent_s is not None else "NOT_SENT",
        "finish_reason": r.finish_reason,
        "tokens": r.num_tokens,
        "cached_tokens": r.num_cached_tokens,
        "ttft_ms": ms(r.ttft_s()) if r.sent_s is not None else None,
        "e2e_ms": ms(r.e2e_s()),
        "itl_ms": [round(g * 1e3, 2) for g in r.itl_s()],
        "engines": r.engines,
        "detail": r.detail,
    } for r in records]
