"""Side by side: the same seeded rate sweep against dualpace, gated (NEO-like) and gpu-only (vLLM-like).

Per policy the system is started fresh as real processes on 127.0.0.1: gpu_service pinned to core 0
with a small KV pool (standing in for scarce GPU memory), cpu_service pinned to core 1 with a large
host pool (not started for gpu-only), and the router (unpinned, like the load generator). The same
requests (seeded lengths, prompts and arrival pattern) are then sent at each rate through the
router's Generate stream (bench.load). Writes bench/results/compare_<tag>.json, a PNG (output token
throughput vs P99 ITL, one line per policy) and a markdown table: throughput at equal P99 ITL
(interpolated along the sweep) and the highest request rate meeting a P99 ITL target.

    python -m bench.compare_policies --rates 0.4,0.8,1.6 --num-requests 24 \\
        --input-len 64:256 --output-len 32:96 --dtype bf16 --threads 1
    python -m bench.compare_policies --report-only bench/results/compare_smollm2-135m.json --itl-target-ms 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path

from bench.cooperative_timeline import check_files, timeline_paths
from bench.compare_policies_sim import (  # noqa: F401  (also imported from here by tests)
    measured_engine_overhead_ms,
    sim_comparison,
    sim_config,
    write_sim_comparison,
)
from bench.load.generator import run_load
from bench.load.report import (
    comparison_table,
    plot_throughput_vs_itl,
    sweep_row,
    sweep_table,
)
from bench.load.stats import summarize
from dualpace.policy.policies import POLICY_NAMES, traits
from toolkit.engine_client import snapshot_preemptions
from toolkit.processes import Daemon, start_daemon
from toolkit.workload import (
    build_requests,
    parse_length_spec,
    parse_rates,
    write_trace,
)


def start_system(args: argparse.Namespace, policy: str) -> list[Daemon]:
    """gpu_service (core 0), cpu_service (core 1; not for gpu-only), router; router last in the list."""
    common = ("--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads))
    profile = ("--profile", args.profile) if args.profile else ()
    timelines = timeline_paths(args.step_timeline_dir, policy, clear=True) if args.step_timeline_dir else {}
    daemons: list[Daemon] = []
    try:
        gpu = start_daemon("gpu_service", *common, *gpu_service_flags(args, policy), cpu_cores="0",
                           step_timeline=timelines.get("gpu"))
        daemons.append(gpu)
        router_flags = ["serve", "--gpu", gpu.address, "--policy", policy, "--model", args.model]
        if traits(policy).uses_cpu_engine:
            cpu = start_daemon("cpu_service", *common, "--name", "cpu", "--kv-blocks", str(args.cpu_kv_blocks),
                               "--gpu-service", gpu.address, "--policy", traits(policy).cpu_service_policy.value,
                               "--assist-timeout-s", "120", "--assist", args.cpu_assist, *profile,
                               cpu_cores="1", step_timeline=timelines.get("cpu"))
            daemons.append(cpu)
            router_flags += ["--cpu", cpu.address]
        router_flags += [*profile, *router_queue_flags(args)]
        if args.admission_itl_target_ms is not None:
            router_flags += ["--itl-target-ms", str(args.admission_itl_target_ms)]
        daemons.append(start_daemon("router", *router_flags))
    except BaseException:
        stop_system(daemons)
        raise
    return daemons


def gpu_service_flags(args: argparse.Namespace, policy: str) -> list[str]:
    """gpu_service's own flags for one policy's run.

    The stand-in GPU is a CPU core: a long prefill step may outlast the 5 s default stage timeout,
    which would end gated joins waiting for it (a local redo), so both sides get 120 s. Under
    `gated` the join's per-layer wait floor is raised too (--gated-join-layer-wait-ms): NEO has no
    local fallback, and on a shared 2-core host a CPU engine descheduled for more than the 50 ms
    default dropped joins and sent gated into local iterations on a loaded host. dualpace keeps
    the server's default: dropping a late join and redoing it locally is its design."""
    flags = ["--name", "gpu", "--kv-blocks", str(args.gpu_kv_blocks), "--assist-stage-timeout-s", "120"]
    if traits(policy).cpu_decodes_inside_gpu_steps and args.gated_join_layer_wait_ms is not None:
        flags += ["--assist-join-min-layer-wait-ms", f"{args.gated_join_layer_wait_ms:g}"]
    return flags


def router_queue_flags(args: argparse.Namespace) -> list[str]:
    """How long the router lets a request wait for room (its --ttft-target-ms): by default as long
    as the load generator waits for it (--timeout-s), for every policy. vLLM queues without a time
    limit; the router's 30 s default refused 10 of 24 gpu-only requests at 4 req/s on a loaded host,
    which is a limit of the bench's router, not of the policy."""
    queue_s = args.timeout_s if args.router_queue_timeout_s is None else args.router_queue_timeout_s
    return ["--ttft-target-ms", f"{1000 * queue_s:g}"] if queue_s > 0 else []


def stop_system(daemons: list[Daemon]) -> None:
    for daemon in reversed(daemons):  # router first
        daemon.stop()


def keep_logs(log_dir: Path, policy: str, daemons: list[Daemon]) -> None:
    """Each daemon's last output lines (the router's: placements and every migration it started) as
    LOG_DIR/<policy>_<daemon>.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    names = ["gpu_service", *(["cpu_service"] if len(daemons) == 3 else []), "router"]
    for name, daemon in zip(names, daemons):
        (log_dir / f"{policy}_{name}.log").write_text(daemon.log())


def cpu_seconds(pid: int) -> float | None:  # user + system CPU time so far (Linux /proc), None where unreadable
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def largest_gaps(records, count: int = 40) -> list[dict]:
    """The largest inter-token gaps seen by the client, with where they happened: the request,
    the token position, the engine path of the request, the gap's start (s after the first send)."""
    first = min((r.sent_s for r in records if r.sent_s is not None), default=0.0)
    gaps = []
    for r in records:
        last, position = None, 0
        for at, n in r.messages:
            if n <= 0:
                continue
            if last is not None:
                gaps.append({"gap_ms": round(1000 * (at - last), 1), "request": r.index, "token": position,
                             "tokens_in_message": n, "engines": " -> ".join(r.engines),
                             "at_s": round(last - first, 3)})
            position += n
            last = at
    gaps.sort(key=lambda g: -g["gap_ms"])
    return gaps[:count]


def run_policy(args: argparse.Namespace, policy: str, rates: list[float]) -> dict:
    print(f"== {policy}: starting the daemons", file=sys.stderr, flush=True)
    daemons = start_system(args, policy)
    router = daemons[-1].address
    ins = parse_length_spec(args.input_len, "--input-len")
    outs = parse_length_spec(args.output_len, "--output-len")
    rows, summaries = [], []
    engines = dict(zip(("gpu_service", "cpu_service"), daemons[:-1]))

    def preemptions() -> dict[str, int | None]:
        """Each engine's running total, from its LoadSnapshot (GetLoad)."""
        return {name: snapshot_preemptions(d.address) for name, d in engines.items()}
    try:
        # Warm-up (not measured): first requests pay for kernel builds and allocations.
        warm = build_requests(2, float("inf"), 1.0, args.seed + 999, args.vocab_size, ins, outs)
        asyncio.run(run_load(router, warm, seed=args.seed, timeout_s=args.timeout_s, run_tag=f"{policy}-warm"))
        for rate in rates:
            specs = build_requests(args.num_requests, rate, args.burstiness, args.seed, args.vocab_size, ins, outs)
            if args.trace_dir:  # the exact requests and arrival times, for `dualpace sim --trace`
                Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                write_trace(Path(args.trace_dir) / f"trace_r{rate:g}.jsonl", specs)
            load_before = os.getloadavg()[0]
            cpu_before = {d.address: cpu_seconds(d.process.pid) for d in daemons}
            preempted_before = preemptions()
            client_before = time.process_time()
            started = time.monotonic()
            result = asyncio.run(run_load(router, specs, seed=args.seed, timeout_s=args.timeout_s,
                                          run_tag=f"{policy}-{rate:g}"))
            summary = summarize(result.records, len(specs), result.duration_s, args.slo_ttft_ms, args.slo_itl_ms)
            row = sweep_row(rate, summary)
            rows.append(row)
            # CPU seconds each process spent on this rate: the engines (pinned), the router and this
            # load generator (unpinned: they share the engines' cores)
            names = ["gpu_service", *(["cpu_service"] if len(daemons) == 3 else []), "router"]
            cpu_used = {name: (None if cpu_before[d.address] is None or cpu_seconds(d.process.pid) is None
                               else round(cpu_seconds(d.process.pid) - cpu_before[d.address], 2))
                        for name, d in zip(names, daemons)}
            cpu_used["load_generator"] = round(time.process_time() - client_before, 2)
            preempted = {name: None if value is None or preempted_before[name] is None else value - preempted_before[name]
                         for name, value in preemptions().items()}
            row["num_preemptions"] = None if None in preempted.values() else sum(preempted.values())
            summaries.append({"rate_rps": rate, "summary": summary,
                              "load_average_1m": {"before": round(load_before, 2),
                                                  "after": round(os.getloadavg()[0], 2)},
                              "cpu_s": cpu_used, "num_preemptions": preempted,
                              "largest_gaps": largest_gaps(result.records)})
            print(f"   {policy} rate {rate:g}/s ({time.monotonic() - started:.0f} s): {summary['accounting']['line']}; "
                  f"{row['request_throughput_rps']} req/s, {row['output_token_throughput_tps']} tok/s, "
                  f"P99 ITL {row['itl_p99_ms']} ms, P99 TTFT {row['ttft_p99_ms']} ms, engines {summary['engines']}, "
                  f"preemptions {preempted}"
                  + (f", failures {summary['failures']}" if summary["failures"] else "")
                  + f", load {load_before:.2f} -> {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
            time.sleep(1.0)  # let aborted requests drain before the next rate
    finally:
        stop_system(daemons)  # the engines write their last timeline records on the way out
        if args.log_dir:
            keep_logs(Path(args.log_dir), policy, daemons)
    if args.step_timeline_dir and traits(policy).uses_cpu_engine:  # gated's two points on the step timelines
        timeline = check_files(timeline_paths(args.step_timeline_dir, policy), policy)
        print(f"   {policy} step timelines:\n{timeline['report']}", file=sys.stderr)
        return {"rows": rows, "runs": summaries, "timeline": timeline}
    return {"rows": rows, "runs": summaries}


def write_reports(report: dict, json_path: Path, itl_target_ms: float) -> str:
    results = {policy: data["rows"] for policy, data in report["policies"].items()}
    table = comparison_table(results, itl_target_ms)
    points = sweep_table(results)
    png = json_path.with_suffix(".png")
    problem = plot_throughput_vs_itl(results, str(png), report.get("title", ""), itl_target_ms)
    report.update(itl_target_ms=itl_target_ms, table_markdown=table, points_markdown=points,
                  plot=None if problem else str(png), plot_problem=problem)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md = json_path.with_suffix(".md")
    md.write_text(f"{report.get('title', '')}\n\n```sh\n{report.get('command', '')}\n```\n\n{table}\n\n{points}\n"
                  + (f"\nNo plot: {problem}\n" if problem else f"\n![plot]({png.name})\n"))
    return table + "\n\n" + points + (f"\n\nno plot: {problem}" if problem else f"\n\nplot: {png}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tag", default=None, help="file name part (default: the model's name)")
    parser.add_argument("--dtype", default="bf16", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--rates", default="0.4,0.8,1.6")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="32:96")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=500)
    parser.add_argument("--gpu-kv-blocks", type=int, default=64, help="small: scarce GPU memory")
    parser.add_argument("--cpu-kv-blocks", type=int, default=1024, help="large: host memory")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="per rate")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument("--itl-target-ms", type=float, default=300.0, help="P99 ITL target of the table")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--profile", default=None,
                        help="profile JSON for cpu_service and the router (their cost model), as `dualpace sim` uses it")
    parser.add_argument("--admission-itl-target-ms", type=float, default=None,
                        help="the router's --itl-target-ms (admission and migration ITL target); unset: capacity rules")
    parser.add_argument("--cpu-assist", default="auto", choices=["auto", "never", "always"],
                        help="cpu_service --assist (dualpace policy; e.g. never: no Dense Assist probes)")
    parser.add_argument("--router-queue-timeout-s", type=float, default=None,
                        help="the router's queue timeout (its --ttft-target-ms); default --timeout-s; 0: the "
                             "router's own default (30 s)")
    parser.add_argument("--gated-join-layer-wait-ms", type=float, default=1000.0,
                        help="gated only: gpu_service --assist-join-min-layer-wait-ms (how long a GPU step waits "
                             "for a join's attention of one layer before it drops the join)")
    parser.add_argument("--step-timeline-dir", default=None, metavar="DIR",
                        help="engines write DIR/<policy>_<engine>.jsonl; bench.cooperative_timeline checks them")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="keep each daemon's last output lines as DIR/<policy>_<daemon>.log")
    parser.add_argument("--trace-dir", default=None,
                        help="write each rate's requests (prompts, output lengths, arrival times) here as "
                             "trace_r<RATE>.jsonl, for `dualpace sim --trace`")
    parser.add_argument("--report-only", default=None, metavar="JSON",
                        help="rebuild the table and plot of an earlier run (e.g. for another --itl-target-ms)")
    parser.add_argument("--sim-profile", default=None, metavar="JSON",
                        help="after the runs (or with --report-only), simulate every run's requests with this "
                             "profile (`dualpace sim`) and write real vs simulated to <json>_sim.{json,md}")
    parser.add_argument("--sim-engine-overhead-ms", type=float, default=0.0,
                        help="the simulation's host time per engine iteration (SimConfig.engine_overhead_ms)")
    parser.add_argument("--sim-suffix", default="_sim", help="file name suffix of the comparison")
    parser.add_argument("--measure-engine-overhead", action="store_true",
                        help="with --report-only and --sim-profile: print, per gpu-only run, gpu_service's CPU time "
                             "minus the simulated busy time, per iteration")
    args = parser.parse_args(argv)

    if args.report_only:
        path = Path(args.report_only)
        report = json.loads(path.read_text())
        if args.sim_profile:
            if args.measure_engine_overhead:
                for row in measured_engine_overhead_ms(report, args.sim_profile, args.trace_dir):
                    print(json.dumps(row))
                return 0
            print(write_sim_comparison(report, path, args.sim_profile, args.trace_dir, args.sim_engine_overhead_ms,
                                       args.sim_suffix))
            return 0
        print(write_reports(report, path, args.itl_target_ms))
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; known: {', '.join(POLICY_NAMES)}")
    rates = parse_rates(args.rates)
    parse_length_spec(args.input_len, "--input-len"), parse_length_spec(args.output_len, "--output-len")
    tag = args.tag or Path(args.model).name.removesuffix(".gguf")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"compare_{tag}.json"
    started = time.monotonic()
    report = {
        "title": f"{tag} {args.dtype}: gpu_service core 0 ({args.gpu_kv_blocks} KV blocks), cpu_service core 1 "
                 f"({args.cpu_kv_blocks} blocks), {args.num_requests} requests/rate, in {args.input_len}, "
                 f"out {args.output_len}",
        "command": "python -m bench.compare_policies " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "config": vars(args),
        "policies": {},
    }
    for policy in policies:
        report["policies"][policy] = run_policy(args, policy, rates)
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(write_reports(report, json_path, args.itl_target_ms))
    print(f"wrote {json_path} ({report['wall_s']} s)", file=sys.stderr)
    if args.sim_profile:
        print(write_sim_comparison(report, json_path, args.sim_profile, args.trace_dir, args.sim_engine_overhead_ms,
                                   args.sim_suffix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
