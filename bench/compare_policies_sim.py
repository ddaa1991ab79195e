"""The simulator's side of bench/compare_policies.py: the same traces through `dualpace sim` with
the policy's configuration, and the real-vs-simulated table."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.workload import build_requests, parse_length_spec


def sim_config(config: dict, policy: str, engine_overhead_ms: float = 0.0):
    """The simulator's configuration of the deployment start_system starts: the engine daemons'
    scheduler defaults (512 tokens, 64 sequences per step), the same KV pools, the router's
    ITL target, and Dense Assist as the daemons run it on one host (the simulator's default
    hold, "cooperative": gated runs every CPU iteration inside a GPU step)."""
    from dualpace.engine.scheduler import SchedulerConfig
    from dualpace.policy.policies import Policy
    from profiles.sim import SimConfig

    step = SchedulerConfig(max_batch_tokens=512, max_running=64, max_waiting=1 << 30)
    return SimConfig(policy=Policy(policy), gpu_scheduler=step, cpu_scheduler=step,
                     itl_target_ms=config.get("admission_itl_target_ms"),
                     gpu_kv_blocks=config["gpu_kv_blocks"], cpu_kv_blocks=config["cpu_kv_blocks"],
                     engine_overhead_ms=engine_overhead_ms)


def _run_specs(config: dict, rate: float, trace_dir: str | None) -> list:
    """The requests a measured run sent: its trace file when there is one, else rebuilt from the seed."""
    from toolkit.workload import load_trace

    path = Path(trace_dir) / f"trace_r{rate:g}.jsonl" if trace_dir else None
    if path is not None and path.exists():
        trace = load_trace(path)
        return build_requests(len(trace), rate, 1.0, 0, config["vocab_size"], trace=trace)
    return build_requests(config["num_requests"], rate, config["burstiness"], config["seed"], config["vocab_size"],
                          parse_length_spec(config["input_len"], "--input-len"),
                          parse_length_spec(config["output_len"], "--output-len"))


def measured_engine_overhead_ms(report: dict, profile_path: str, trace_dir: str | None = None) -> list[dict]:
    """Per gpu-only run: (gpu_service's CPU seconds - the simulated GPU engine's busy time) / its
    iterations, i.e. the host time per iteration the profile's forward-pass tables do not contain.
    CPU time counts only when the process ran, so other tenants of the core do not inflate it."""
    from dualpace.profile.cost_model import CostModel
    from dualpace.profile.files import load_profile
    from profiles.sim import GPU, Simulator

    cost = CostModel(load_profile(profile_path))
    config = report["config"]
    out = []
    for row, run in zip(report["policies"].get("gpu-only", {}).get("rows", []),
                        report["policies"].get("gpu-only", {}).get("runs", [])):
        cpu_s = (run.get("cpu_s") or {}).get("gpu_service")
        if cpu_s is None:
            continue
        sim = Simulator(cost, sim_config(config, "gpu-only"))
        sim.run(_run_specs(config, row["rate_rps"], trace_dir or config.get("trace_dir")))
        engine = sim.engines[GPU]
        out.append({"rate_rps": row["rate_rps"], "gpu_service_cpu_s": cpu_s,
                    "simulated_busy_s": round(engine.busy_ms / 1000, 3), "iterations": engine.num_iterations,
                    "overhead_ms_per_iteration": round((1000 * cpu_s - engine.busy_ms) / engine.num_iterations, 3)})
    return out


def write_sim_comparison(report: dict, json_path: Path, profile_path: str, trace_dir: str | None,
                         engine_overhead_ms: float = 0.0, suffix: str = "_sim") -> str:
    rows, table = sim_comparison(report, profile_path, trace_dir, engine_overhead_ms=engine_overhead_ms)
    out = json_path.with_name(json_path.stem + suffix + ".json")
    head = f"real: {json_path}, simulated with {profile_path}, engine overhead {engine_overhead_ms:g} ms per iteration"
    out.write_text(json.dumps({"profile": profile_path, "real": str(json_path), "engine_overhead_ms": engine_overhead_ms,
                               "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(f"{head}\n\n{table}\n")
    return table + f"\n\nwrote {out}"


def _error_pct(real: float | None, sim: float | None) -> float | None:
    if real is None or sim is None or real == 0:
        return None
    return round(100.0 * (sim - real) / real, 1)


def sim_comparison(report: dict, profile_path: str, trace_dir: str | None = None,
                   tolerance_pct: float = 15.0, engine_overhead_ms: float = 0.0) -> tuple[list[dict], str]:
    """`dualpace sim` on every measured run's requests (the trace written with --trace-dir when
    there is one, else the same seeded requests rebuilt): real vs simulated throughput and P99 ITL."""
    from dualpace.profile.cost_model import CostModel
    from dualpace.profile.files import load_profile
    from profiles.sim import simulate

    config = report["config"]
    cost = CostModel(load_profile(profile_path))
    trace_dir = trace_dir or config.get("trace_dir")
    rows = []
    for policy, data in report["policies"].items():
        for row, run in zip(data["rows"], data["runs"]):
            rate = row["rate_rps"]
            specs = _run_specs(config, rate, trace_dir)
            sim = simulate(cost, sim_config(config, policy, engine_overhead_ms), specs, rate).as_dict()
            out = {"policy": policy, "rate_rps": rate, "load_average_1m": run.get("load_average_1m"),
                   "real_rps": row["request_throughput_rps"], "sim_rps": sim["requests_per_s"],
                   "real_tps": row["output_token_throughput_tps"], "sim_tps": sim["throughput_tokens_per_s"],
                   "real_itl_p99_ms": row["itl_p99_ms"], "sim_itl_p99_ms": sim["p99_itl_ms"],
                   "real_itl_p50_ms": row["itl_p50_ms"], "sim_itl_p50_ms": sim["p50_itl_ms"],
                   "real_ttft_p50_ms": row["ttft_p50_ms"], "sim_ttft_p50_ms": sim["p50_ttft_ms"],
                   "sim_cpu_local_assisted": [sim["cpu_local_iterations"], sim["cpu_assisted_iterations"]],
                   "sim_moves": [sim["num_handoffs"], sim["num_migrations"]],
                   # where the tokens were decoded: a simulated request that stays on the GPU engine sees
                   # its prefill steps as ITL gaps
                   "real_gpu_engine_tokens": (run.get("summary") or {}).get("tokens_by_engine", {}).get("gpu"),
                   "sim_gpu_engine_tokens": sim["num_gpu_engine_tokens"]}
            out["err_tps_pct"] = _error_pct(out["real_tps"], out["sim_tps"])
            out["err_rps_pct"] = _error_pct(out["real_rps"], out["sim_rps"])
            out["err_itl_p99_pct"] = _error_pct(out["real_itl_p99_ms"], out["sim_itl_p99_ms"])
            rows.append(out)

    def ok(err: float | None) -> str:
        return "-" if err is None else ("yes" if abs(err) <= tolerance_pct else "**no**")

    def f(value, digits=1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [("| policy | rate req/s | load 1m | req/s real / sim (err %) | tok/s real / sim (err %) | "
              "P99 ITL ms real / sim (err %) | P50 ITL ms real / sim | P50 TTFT ms real / sim | "
              f"tokens by the GPU engine real / sim | within {tolerance_pct:g}%: tok/s, P99 ITL |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        load = r["load_average_1m"]
        load_text = f"{load['before']:.1f}-{load['after']:.1f}" if load else "-"
        lines.append(f"| {r['policy']} | {r['rate_rps']:g} | {load_text} | "
                     f"{f(r['real_rps'], 2)} / {f(r['sim_rps'], 2)} ({f(r['err_rps_pct'])}) | "
                     f"{f(r['real_tps'])} / {f(r['sim_tps'])} ({f(r['err_tps_pct'])}) | "
                     f"{f(r['real_itl_p99_ms'])} / {f(r['sim_itl_p99_ms'])} ({f(r['err_itl_p99_pct'])}) | "
                     f"{f(r['real_itl_p50_ms'])} / {f(r['sim_itl_p50_ms'])} | "
                     f"{f(r['real_ttft_p50_ms'], 0)} / {f(r['sim_ttft_p50_ms'], 0)} | "
                     f"{f(r['real_gpu_engine_tokens'], 0)} / {r['sim_gpu_engine_tokens']} | "
                     f"{ok(r['err_tps_pct'])}, {ok(r['err_itl_p99_pct'])} |")
    return rows, "\n".join(lines)
