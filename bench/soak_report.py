"""The soak's verdict: its result object (every request classified, leaks, RSS growth,
migrations, problems) and the summary table printed at the end (bench/soak.py runs it)."""

from __future__ import annotations

import argparse
import shlex
from typing import Protocol

from bench.soak_client import (
    CANCELLED,
    COMPLETED,
    INVALID_REJECTED,
    LOST,
    WRONG,
    RequestOutcome,
    Tally,
)

class SoakRun(Protocol):
    """What the verdict reads of a finished soak (bench.soak.Soak has these); a protocol, so
    the report does not import the driver that imports it."""
    args: argparse.Namespace
    slots: dict
    outcomes: list[RequestOutcome]
    faults: list[dict]
    migrations_seen: dict[tuple, str]
    migration_failures: dict[tuple, str]
    load_started: float | None
    restart_serving_s: float | None
    router_reconnected_s: float | None


def report(soak: SoakRun, window_s: float, wall_s: float, loads: dict, exit_codes: dict, migrations_metric) -> dict:
    a = soak.args
    tally = Tally.of(soak.outcomes)
    s = tally.by_status
    rss = {}
    for role, slot in soak.slots.items():
        start, end = slot.rss_start_kib, slot.rss_end_kib
        rss[role] = {"start_mib": None if start is None else round(start / 1024, 1),
                     "end_mib": None if end is None else round(end / 1024, 1),
                     "growth_pct": None if not start or end is None else round(100 * (end - start) / start, 2),
                     "since": "restart + warm-up" if slot.restarted_at_s is not None else "warm-up",
                     "series": slot.rss_series}
    leaked = {role: load.get("kv_blocks_used") for role, load in loads.items()}
    committed = sum(1 for o in soak.migrations_seen.values() if o == "COMMITTED")
    restarted = a.restart
    after_restart = [o for o in soak.outcomes if soak.restart_serving_s is not None and o.status == COMPLETED
                     and o.sent_s - soak.load_started >= soak.restart_serving_s]
    on_restarted = [o for o in after_restart if restarted in o.engines]
    wrong = [o for o in soak.outcomes if o.status == WRONG]
    lost = [o for o in soak.outcomes if o.status == LOST]
    result = {
        "requests_sent": tally.sent,
        "completed": s[COMPLETED],
        "failed_by_code": dict(sorted(tally.failed_by_code.items())),
        "cancelled": s[CANCELLED],
        "invalid_rejected": s[INVALID_REJECTED],
        "lost": s[LOST],
        "wrong": s[WRONG],
        "blocks_leaked": leaked,
        "rss_growth_pct": {role: r["growth_pct"] for role, r in rss.items()},
        "migrations": {
            "committed_seen_in_list_placements": committed,
            "failed_seen_in_list_placements": sum(1 for o in soak.migrations_seen.values() if o == "FAILED"),
            "router_metric": migrations_metric,
            "failed_examples": [f"{k[0]} {k[1]}->{k[2]}: {d}" for k, d in list(soak.migration_failures.items())[:5]],
        },
        "faults_injected": {
            "client_cancellations": sum(1 for o in soak.outcomes if o.request.kind == "cancel"),
            "invalid_requests": sum(1 for o in soak.outcomes if o.request.kind == "invalid"),
            "engine_restarts": soak.faults,
        },
        "completed_after_restart": len(after_restart),
        "completed_after_restart_on_restarted_engine": len(on_restarted),
        "duration_s": round(window_s, 1),
        "wall_s": round(wall_s, 1),
        "rss_mib": rss,
        "final_loads": loads,
        "exit_codes": exit_codes,
        "examples": {"lost": [_describe(o) for o in lost[:5]], "wrong": [_describe(o) for o in wrong[:5]],
                     "failed": [_describe(o) for o in soak.outcomes if o.status == "failed"][:5]},
        "config": {k: v for k, v in vars(a).items() if k != "json"},
        "command": "python -m bench.soak " + " ".join(shlex.quote(x) for x in (a.argv or [])),
    }
    problems = []
    if result["lost"]:
        problems.append(f"{result['lost']} requests lost")
    if result["wrong"]:
        problems.append(f"{result['wrong']} requests ended wrongly (see examples)")
    for role, n in leaked.items():
        if n != 0:
            problems.append(f"{role}: {n} KV blocks leaked" if n is not None else f"{role}: load unreadable")
    for role, pct in result["rss_growth_pct"].items():
        if pct is None:
            problems.append(f"{role}: RSS growth not measured (too short after warm-up?)")
        elif pct >= a.max_rss_growth_pct:
            problems.append(f"{role}: RSS grew {pct}% (limit {a.max_rss_growth_pct}%)")
    if committed == 0 and not any(k.endswith("/committed") and v for k, v in (migrations_metric or {}).items()):
        problems.append("no migration committed")
    if a.restart != "none":
        if soak.router_reconnected_s is None:
            problems.append(f"the router did not reconnect to the restarted {a.restart}")
        if not after_restart:
            problems.append("no request completed after the restart")
    if any(code not in (0, None) for code in exit_codes.values()):
        problems.append(f"daemon exit codes {exit_codes}")
    result["problems"] = problems
    result["ok"] = not problems
    return result


def _describe(outcome: RequestOutcome) -> dict:
    r = outcome.request
    return {"request_id": r.request_id, "kind": r.kind, "status": outcome.status, "code": outcome.code,
            "detail": outcome.detail, "tokens": outcome.num_tokens, "expected": r.spec.output_len,
            "finish": outcome.finish_reason, "engines": outcome.engines}


def summary_table(result: dict) -> str:
    rows = [
        ("requests sent", result["requests_sent"]),
        ("completed (exact length)", result["completed"]),
        ("failed, explicit error", sum(result["failed_by_code"].values())),
        *((f"  {code}", n) for code, n in result["failed_by_code"].items()),
        ("cancelled by the client", result["cancelled"]),
        ("invalid -> INVALID_ARGUMENT", result["invalid_rejected"]),
        ("lost", result["lost"]),
        ("wrong (bad length / invalid accepted)", result["wrong"]),
        *((f"KV blocks leaked: {role}", n) for role, n in result["blocks_leaked"].items()),
        *((f"RSS growth {role} ({r['since']})", f"{r['growth_pct']}% ({r['start_mib']} -> {r['end_mib']} MiB)")
          for role, r in result["rss_mib"].items()),
        ("migrations committed (ListPlacements)", result["migrations"]["committed_seen_in_list_placements"]),
        ("migrations (router metric)", result["migrations"]["router_metric"]),
        ("client cancellations injected", result["faults_injected"]["client_cancellations"]),
        ("invalid requests injected", result["faults_injected"]["invalid_requests"]),
        ("engine restarts", ", ".join(f"{f['engine']} killed at {f['killed_at_s']} s holding "
                                      f"{f['requests_on_engine_when_killed']} requests, serving at "
                                      f"{f.get('serving_again_at_s')} s, router reconnected at "
                                      f"{f.get('router_reconnected_at_s')} s"
                                      for f in result["faults_injected"]["engine_restarts"]) or "none"),
        ("completed after the restart (on the restarted engine)",
         f"{result['completed_after_restart']} ({result['completed_after_restart_on_restarted_engine']})"),
        ("load duration / wall (s)", f"{result['duration_s']} / {result['wall_s']}"),
        ("daemon exit codes", result["exit_codes"]),
        ("verdict", "OK" if result["ok"] else "FAILED: " + "; ".join(result["problems"])),
    ]
    width = max(len(str(k)) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
