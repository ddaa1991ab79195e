"""`dualpace sim`: run a workload through the discrete-event simulator (profiles.sim):
the real schedulers, admission and migration planner, timed by a profile's cost model."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dualpace.errors import InvalidArgument
from dualpace.policy.policies import POLICY_NAMES, Policy, policy_help
from profiles.sim.config import ASSIST_DEVICE_HOLDS


def register(subparsers) -> None:
    p = subparsers.add_parser("sim", help="simulate serving a workload on a profiled machine (no GPU needed)")
    p.add_argument("--profile", required=True, help="profile JSON (e.g. profiles/reference/*.json)")
    p.add_argument("--policy", default=Policy.DUALPACE.value,
                   help=f"one or several comma-separated (each is run): {policy_help()}")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    rate.add_argument("--rates", help="sweep: comma-separated rates, e.g. 1,2,4,8")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals: 1 is Poisson, >1 burstier")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default 100, or every line of a --trace with arrival times")
    p.add_argument("--input-len", default="512", help="N | LO:HI | lognormal:MEAN:SIGMA")
    p.add_argument("--output-len", default="128", help="N | LO:HI | lognormal:MEAN:SIGMA")
    p.add_argument("--trace", help="JSONL trace (input_len or prompt_token_ids, output_len per line; with arrival_s "
                                   "on every line the requests arrive then and --rate/--burstiness are unused)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                   help="each simulated engine's prefix cache, as on the daemons (default on)")
    p.add_argument("--workload", default="random", choices=["random", "shared-prefix"],
                   help="random: --input-len/--trace; shared-prefix: one --system-len system prompt shared by "
                        "every request, then its own --question-len question (as `dualpace bench`)")
    p.add_argument("--system-len", type=int, default=1000, help="shared-prefix: the shared system prompt's tokens")
    p.add_argument("--question-len", default="16:64", help="shared-prefix: SPEC of each question")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="admission: an engine whose predicted ITL with one more request exceeds it takes none")
    p.add_argument("--gpu-admission", choices=("reserve", "optimistic"), default=None,
                   help="how admission counts the GPU engine's KV: optimistic (allocated now + 1%% watermark; the "
                        "engine preempts by recompute, as vLLM V1) or reserve (prompt + max_tokens per request). "
                        "Default: optimistic for gpu-only, reserve for dualpace and gated")
    p.add_argument("--gpu-max-batch-tokens", type=int, default=2048)
    p.add_argument("--gpu-max-running", type=int, default=256)
    p.add_argument("--cpu-max-running", type=int, default=128)
    p.add_argument("--cpu-max-batch-tokens", type=int, default=512)
    p.add_argument("--engine-overhead-ms", type=float, default=0.0,
                   help="host time per engine iteration outside the forward pass (engine loop, streaming), "
                        "which the profile's tables lack; delays the iteration's tokens, not the GPU (default 0)")
    p.add_argument("--view-interval-ms", type=float, default=100.0,
                   help="how old the router's view of an engine's KV use may be (WatchLoad interval; 0: instantaneous)")
    p.add_argument("--gpu-kv-blocks", type=int, default=None, help="GPU engine's KV pool in blocks (default: the profile's)")
    p.add_argument("--cpu-kv-blocks", type=int, default=None, help="CPU engine's KV pool in blocks (default: the profile's)")
    p.add_argument("--assist-device-hold", choices=ASSIST_DEVICE_HOLDS, default=ASSIST_DEVICE_HOLDS[0],
                   help="how an Assisted CPU iteration holds the GPU, as the daemons do. cooperative (default: "
                        "gpu_service on the same host): its decode rows join the GPU engine's next step, laid out "
                        "by the daemons' planner (dualpace.policy.cooperative_plan), dualpace's only when that "
                        "step begins within one GPU layer, else per-layer stages; gated is NEO as built (CPU "
                        "requests advance only inside GPU steps). layer (no joins: gpu_service on another host): "
                        "dualpace per-layer stages; gated holds the GPU for the whole iteration")
    p.add_argument("--out", help="sweep: write the results JSON here (and a PNG beside it if matplotlib imports)")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list for several runs)")
    p.add_argument("--itl-targets-ms", default=None,
                   help="with --out: also write <out>.md, per P99 ITL target (comma-separated) each policy's "
                        "throughput at that P99 ITL (interpolated along the sweep) and the highest rate meeting it, "
                        "as bench.compare_policies reports real runs")


def _policies(text: str):
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or any(name not in POLICY_NAMES for name in names):
        raise InvalidArgument("--policy", f"expected {', '.join(POLICY_NAMES)} (comma-separated), got {text!r}")
    return [Policy(name) for name in names]


def _plot(results: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - the plot is optional
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in results):
        rows = [r for r in results if r["policy"] == policy and r["p99_itl_ms"] is not None]
        ax.plot([r["p99_itl_ms"] for r in rows], [r["throughput_tokens_per_s"] for r in rows], marker="o", label=policy)
    ax.set_xlabel("P99 ITL (ms)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("simulated: throughput vs P99 ITL")
    ax.legend()
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _bench_rows(results: list[dict]) -> dict[str, list[dict]]:
    """Simulated results as bench.load.report's sweep rows, per policy."""
    rows: dict[str, list[dict]] = {}
    for r in results:
        rows.setdefault(r["policy"], []).append({
            "rate_rps": r["rate"], "request_throughput_rps": r["requests_per_s"],
            "output_token_throughput_tps": r["throughput_tokens_per_s"], "itl_p99_ms": r["p99_itl_ms"],
            "failed": r["requests_rejected"]})
    return rows


def _target_tables(results: list[dict], targets: list[float], args: argparse.Namespace) -> str:
    from bench.load.report import comparison_table, value_at_itl

    rows = _bench_rows(results)
    parts = [f"Simulated with {args.profile} (`dualpace sim`), {args.num_requests} requests per rate, seed {args.seed}.\n"]
    for target in targets:
        parts.append(comparison_table(rows, target))
        product = Policy.DUALPACE.value
        if product in rows:
            base, _ = value_at_itl(rows[product], target, "output_token_throughput_tps")
            base_rate, _ = value_at_itl(rows[product], target, "rate_rps")
            gains = []
            for policy, other in rows.items():
                if policy == product:
                    continue
                tps, _ = value_at_itl(other, target, "output_token_throughput_tps")
                rate, _ = value_at_itl(other, target, "rate_rps")
                if base and tps:
                    gains.append(f"tok/s {100 * (base / tps - 1):+.1f}% vs {policy}")
                if base_rate and rate:
                    gains.append(f"rate {100 * (base_rate / rate - 1):+.1f}% vs {policy}")
            if gains:
                parts.append(f"{product} at P99 ITL = {target:g} ms: " + ", ".join(gains))
    return "\n\n".join(parts) + "\n"


def _specs(args: argparse.Namespace, rate: float, vocab_size: int, input_len, output_len, trace) -> list:
    if args.workload == "shared-prefix":
        from bench.load.workloads import shared_prefix_requests

        workload_args = argparse.Namespace(**{**vars(args), "vocab_size": vocab_size, "input_len": None,
                                              "output_len": args.output_len})
        return shared_prefix_requests(workload_args, rate)
    from toolkit.workload import build_requests

    return build_requests(args.num_requests, rate, args.burstiness, args.seed, vocab_size, input_len, output_len, trace)


def run(args: argparse.Namespace) -> int:
    from dualpace.engine.scheduler import SchedulerConfig
    from dualpace.policy.admission import GpuAdmission
    from dualpace.profile.cost_model import CostModel
    from dualpace.profile.files import load_profile
    from profiles.sim import SimConfig, simulate
    from profiles.sim.results import join_summary
    from toolkit.workload import (
        load_trace,
        parse_length_spec,
        parse_rates,
        trace_has_arrivals,
    )

    policies = _policies(args.policy)
    rates = parse_rates(args.rates) if args.rates else [args.rate]
    for flag, value in (("--engine-overhead-ms", args.engine_overhead_ms), ("--view-interval-ms", args.view_interval_ms)):
        if not value >= 0:
            raise InvalidArgument(flag, f"must be >= 0, got {value}")
    for flag, value in (("--gpu-max-batch-tokens", args.gpu_max_batch_tokens),
                        ("--gpu-max-running", args.gpu_max_running), ("--cpu-max-running", args.cpu_max_running),
                        ("--cpu-max-batch-tokens", args.cpu_max_batch_tokens),
                        ("--gpu-kv-blocks", args.gpu_kv_blocks), ("--cpu-kv-blocks", args.cpu_kv_blocks)):
        if value is not None and value < 1:
            raise InvalidArgument(flag, f"must be >= 1, got {value}")
    profile = load_profile(args.profile)
    cost = CostModel(profile)
    trace = load_trace(args.trace) if args.trace else None
    if args.num_requests is None:
        args.num_requests = len(trace) if trace_has_arrivals(trace) else 100
    if args.workload == "shared-prefix" and args.trace:
        raise InvalidArgument("--workload", "shared-prefix makes its own prompts: drop --trace")
    input_len = None if trace else parse_length_spec(args.input_len, "--input-len")
    output_len = None if trace else parse_length_spec(args.output_len, "--output-len")

    results = []
    for policy in policies:
        config = SimConfig(
            policy=policy,
            gpu_scheduler=SchedulerConfig(max_batch_tokens=args.gpu_max_batch_tokens,
                                          max_running=args.gpu_max_running, max_waiting=1 << 30),
            cpu_scheduler=SchedulerConfig(max_batch_tokens=args.cpu_max_batch_tokens, max_running=args.cpu_max_running,
                                          max_waiting=1 << 30),
            gpu_kv_blocks=args.gpu_kv_blocks,
            cpu_kv_blocks=args.cpu_kv_blocks,
            engine_overhead_ms=args.engine_overhead_ms,
            view_interval_ms=args.view_interval_ms,
            itl_target_ms=args.itl_target_ms,
            assist_device_hold=args.assist_device_hold,
            gpu_admission=GpuAdmission(args.gpu_admission) if args.gpu_admission else None,
            prefix_caching=args.prefix_caching == "on",
        )
        for rate in rates:
            specs = _specs(args, rate, profile.model.vocab_size, input_len, output_len, trace)
            result = simulate(cost, config, specs, rate).as_dict()
            results.append(result)
            if not args.json:
                print(f"{result['policy']:>9} rate {rate:>7g}/s: {result['throughput_tokens_per_s']:9.1f} tok/s, "
                      f"{result['requests_completed']}/{result['num_requests']} done, "
                      f"TTFT p50 {result['p50_ttft_ms']} p99 {result['p99_ttft_ms']} ms, "
                      f"ITL p50 {result['p50_itl_ms']} p99 {result['p99_itl_ms']} ms, "
                      f"cpu iters {result['cpu_local_iterations']} local / {result['cpu_assisted_iterations']} assisted, "
                      f"{result['num_preemptions']} preemptions, prefix cache hit rate "
                      f"{result['prefix_cache_hit_rate']} ({result['prefill_tokens_saved']} prefill tokens saved)"
                      + join_summary(result),
                      file=sys.stdout, flush=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps({"profile": str(args.profile), "simulated": True, "seed": args.seed,
                                   "num_requests": args.num_requests, "input_len": args.input_len,
                                   "output_len": args.output_len, "burstiness": args.burstiness,
                                   "itl_target_ms": args.itl_target_ms, "trace": args.trace,
                                   "gpu_kv_blocks": args.gpu_kv_blocks, "cpu_kv_blocks": args.cpu_kv_blocks,
                                   "engine_overhead_ms": args.engine_overhead_ms,
                                   "view_interval_ms": args.view_interval_ms,
                                   "assist_device_hold": args.assist_device_hold,
                                   "gpu_admission": args.gpu_admission, "results": results}, indent=1) + "\n")
        png = _plot(results, out)
        if args.itl_targets_ms:
            md = out.with_suffix(".md")
            md.write_text(_target_tables(results, parse_rates(args.itl_targets_ms, "--itl-targets-ms"), args))
        if not args.json:
            print(f"wrote {out}" + (f" and {png}" if png else " (no PNG: matplotlib does not import)"))
    return 0
