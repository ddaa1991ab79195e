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
import shlex
import sys
import time
from pathlib import Path

from bench.load.generator import run_load
from bench.load.lengths import build_requests, parse_length_spec, parse_rates
from bench.load.report import (
    comparison_table,
    plot_throughput_vs_itl,
    sweep_row,
    sweep_table,
)
from bench.load.stats import summarize
from bench.processes import Daemon, start_daemon

POLICIES = ("dualpace", "gated", "gpu-only")


def start_system(args: argparse.Namespace, policy: str) -> list[Daemon]:
    """gpu_service (core 0), cpu_service (core 1; not for gpu-only), router; router last in the list."""
    common = ("--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads))
    daemons: list[Daemon] = []
    try:
        gpu = start_daemon("gpu_service", *common, "--name", "gpu", "--kv-blocks", str(args.gpu_kv_blocks),
                           cpu_cores="0")
        daemons.append(gpu)
        router_flags = ["serve", "--gpu", gpu.address, "--policy", policy, "--model", args.model]
        if policy != "gpu-only":
            cpu = start_daemon("cpu_service", *common, "--name", "cpu", "--kv-blocks", str(args.cpu_kv_blocks),
                               "--gpu-service", gpu.address, "--policy", "gated" if policy == "gated" else "dualpace",
                               "--assist-timeout-s", "120", cpu_cores="1")
            daemons.append(cpu)
            router_flags += ["--cpu", cpu.address]
        daemons.append(start_daemon("router", *router_flags))
    except BaseException:
        stop_system(daemons)
        raise
    return daemons


def stop_system(daemons: list[Daemon]) -> None:
    for daemon in reversed(daemons):  # router first
        daemon.stop()


def run_policy(args: argparse.Namespace, policy: str, rates: list[float]) -> dict:
    print(f"== {policy}: starting the daemons", file=sys.stderr, flush=True)
    daemons = start_system(args, policy)
    router = daemons[-1].address
    ins = parse_length_spec(args.input_len, "--input-len")
    outs = parse_length_spec(args.output_len, "--output-len")
    rows, summaries = [], []
    try:
        # Warm-up (not measured): first requests pay for kernel builds and allocations.
        warm = build_requests(2, float("inf"), 1.0, args.seed + 999, args.vocab_size, ins, outs)
        asyncio.run(run_load(router, warm, seed=args.seed, timeout_s=args.timeout_s, run_tag=f"{policy}-warm"))
        for rate in rates:
            specs = build_requests(args.num_requests, rate, args.burstiness, args.seed, args.vocab_size, ins, outs)
            started = time.monotonic()
            result = asyncio.run(run_load(router, specs, seed=args.seed, timeout_s=args.timeout_s,
                                          run_tag=f"{policy}-{rate:g}"))
            summary = summarize(result.records, len(specs), result.duration_s, args.slo_ttft_ms, args.slo_itl_ms)
            row = sweep_row(rate, summary)
            rows.append(row)
            summaries.append({"rate_rps": rate, "summary": summary})
            print(f"   {policy} rate {rate:g}/s ({time.monotonic() - started:.0f} s): {summary['accounting']['line']}; "
                  f"{row['request_throughput_rps']} req/s, {row['output_token_throughput_tps']} tok/s, "
                  f"P99 ITL {row['itl_p99_ms']} ms, P99 TTFT {row['ttft_p99_ms']} ms, engines {summary['engines']}"
                  + (f", failures {summary['failures']}" if summary["failures"] else ""), file=sys.stderr, flush=True)
            time.sleep(1.0)  # let aborted requests drain before the next rate
    finally:
        stop_system(daemons)
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
    parser.add_argument("--policies", default=",".join(POLICIES))
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
    parser.add_argument("--report-only", default=None, metavar="JSON",
                        help="rebuild the table and plot of an earlier run (e.g. for another --itl-target-ms)")
    args = parser.parse_args(argv)

    if args.report_only:
        path = Path(args.report_only)
        print(write_reports(json.loads(path.read_text()), path, args.itl_target_ms))
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
