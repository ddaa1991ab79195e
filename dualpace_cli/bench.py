"""`dualpace bench`: open-loop load against a running router; a JSON report (and a plot for sweeps).

    dualpace bench --router 127.0.0.1:50051 --rate 2 --num-requests 100 \\
        --input-len 64:256 --output-len lognormal:64:0.5 --slo-ttft-ms 2000 --slo-itl-ms 200 --out r.json
    dualpace bench --router ADDR --rates 0.5,1,2 --num-requests 24 --input-len 128 --output-len 64 --out sweep.json

Arrivals follow a gamma process (shape 1/burstiness; 1 is Poisson) at --rate requests/s; prompts are
random token ids (seeded) of the input length, sent with ignore_eos and max_tokens = output length.
A length SPEC is N, LO:HI (uniform, inclusive) or lognormal:MEAN:SIGMA; --trace takes a JSONL file
with input_len (or prompt_token_ids) and output_len per line instead. The run is bounded by
--num-requests and --timeout-s (requests still running then are cancelled and count as failed,
DEADLINE_EXCEEDED). --rates sweeps: the same seeded requests at each rate, one JSON with a row per
rate and a PNG (throughput vs P99 ITL) beside it. --workload shared-prefix / multi-turn send chat
traffic for the prefix cache instead (bench/load/workloads.py), and report its hit rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DEFAULT_VOCAB = 500  # ids 1..499 exist in every model here (the tiny test models have 512)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="open-loop load against a running router; JSON report")
    p.add_argument("--router", required=True, help="router address HOST:PORT")
    rates = p.add_mutually_exclusive_group(required=True)
    rates.add_argument("--rate", type=float, help="requests per second (inf: all at once)")
    rates.add_argument("--rates", help="sweep: comma-separated rates, e.g. 0.5,1,2")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape = 1/burstiness; 1 is Poisson")
    p.add_argument("--num-requests", type=int, required=True)
    p.add_argument("--input-len", default=None, help="SPEC: N, LO:HI or lognormal:MEAN:SIGMA")
    p.add_argument("--output-len", default=None, help="SPEC: N, LO:HI or lognormal:MEAN:SIGMA")
    p.add_argument("--trace", default=None, help="JSONL: input_len or prompt_token_ids, and output_len per line")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="random prompt ids are drawn from 1..N-1")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run (per rate when sweeping)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="goodput: the request's P99 ITL at most this")
    p.add_argument("--out", required=True, help="report JSON (sweeps also write FILE.png)")
    from bench.load.workloads import add_workload_arguments
    add_workload_arguments(p)


def build_specs(args: argparse.Namespace, rate: float):
    from dualpace.errors import InvalidArgument
    from toolkit.workload import build_requests, load_trace, parse_length_spec

    if args.workload != "random":
        from bench.load.workloads import workload_plan
        return workload_plan(args, rate)
    if args.trace is not None:
        if args.input_len is not None or args.output_len is not None:
            raise InvalidArgument("--trace", "give either --trace or --input-len/--output-len, not both")
        return build_requests(args.num_requests, rate, args.burstiness, args.seed, args.vocab_size,
                              trace=load_trace(args.trace))
    if args.input_len is None:
        raise InvalidArgument("--input-len", "required (or --trace)")
    if args.output_len is None:
        raise InvalidArgument("--output-len", "required (or --trace)")
    return build_requests(args.num_requests, rate, args.burstiness, args.seed, args.vocab_size,
                          parse_length_spec(args.input_len, "--input-len"),
                          parse_length_spec(args.output_len, "--output-len"))


def check_args(args: argparse.Namespace) -> list[float]:
    """The rates to run; InvalidArgument naming the flag for bad values."""
    from dualpace.errors import InvalidArgument
    from toolkit.workload import parse_rates

    rates = parse_rates(args.rates) if args.rates is not None else [args.rate]
    if args.rate is not None and not args.rate > 0:
        raise InvalidArgument("--rate", f"must be > 0, got {args.rate}")
    if args.num_requests < 1:
        raise InvalidArgument("--num-requests", f"must be >= 1, got {args.num_requests}")
    if not args.timeout_s > 0:
        raise InvalidArgument("--timeout-s", f"must be > 0, got {args.timeout_s}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InvalidArgument("--max-concurrency", f"must be >= 1, got {args.max_concurrency}")
    for flag in ("slo_ttft_ms", "slo_itl_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise InvalidArgument(f"--{flag.replace('_', '-')}", f"must be > 0, got {value}")
    return rates


def run_one(args: argparse.Namespace, rate: float, run_tag: str) -> dict:
    """One run at one rate -> {"rate_rps", "summary", "requests"}."""
    import asyncio

    from bench.load.generator import run_load
    from bench.load.stats import request_rows, summarize

    if args.workload != "random":
        from bench.load.conversations import run_workload
        return run_workload(args, rate, run_tag)
    specs = build_specs(args, rate)
    result = asyncio.run(run_load(args.router, specs, seed=args.seed, timeout_s=args.timeout_s,
                                  max_concurrency=args.max_concurrency, run_tag=run_tag))
    summary = summarize(result.records, len(specs), result.duration_s, args.slo_ttft_ms, args.slo_itl_ms)
    return {"rate_rps": rate, "summary": summary, "requests": request_rows(result.records)}


def one_line(rate: float, summary: dict) -> str:
    acc = summary["accounting"]
    return (f"rate {rate:g}/s: {acc['line']}; {summary['request_throughput_rps']:.3f} req/s, "
            f"{summary['output_token_throughput_tps']:.1f} tok/s, goodput {summary['goodput_rps']:.3f} req/s; "
            f"TTFT P50/P99 {summary['ttft']['p50_ms']}/{summary['ttft']['p99_ms']} ms; "
            f"ITL P50/P99 {summary['itl']['p50_ms']}/{summary['itl']['p99_ms']} ms"
            + (f"; prefix-cache hit rate {summary['prefix_cache_hit_rate']}" if summary["cached_prompt_tokens"] else "")
            + (f"; failures {summary['failures']}" if summary["failures"] else ""))


def strict_json(value):
    """inf/nan floats (e.g. --rate inf) as strings, so the report is standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def run(args: argparse.Namespace) -> int:
    import time

    from bench.load.report import plot_throughput_vs_itl, sweep_row

    rates = check_args(args)
    build_specs(args, rates[0])  # bad SPECs / trace fail before any traffic
    config = {k: v for k, v in vars(args).items() if k not in ("func",)}
    runs = []
    for i, rate in enumerate(rates):
        done = run_one(args, rate, run_tag=f"{int(time.time())}-{i}")
        runs.append(done)
        print(one_line(rate, done["summary"]), file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.rates is None:
        report = {"config": config, **runs[0]}
    else:
        rows = [sweep_row(r["rate_rps"], r["summary"]) for r in runs]
        png = out.with_suffix(".png")
        report = {"config": config, "rows": rows, "runs": runs, "plot": str(png)}
        problem = plot_throughput_vs_itl({"router": rows}, str(png), f"dualpace bench sweep ({args.router})")
        if problem is not None:
            report["plot"] = None
            report["plot_problem"] = problem
            print(f"dualpace bench: no plot: {problem}", file=sys.stderr)
    out.write_text(json.dumps(strict_json(report), indent=2, allow_nan=False) + "\n")
    print(f"dualpace bench: wrote {out}" + (f" and {report['plot']}" if report.get("plot") else ""),
          file=sys.stderr)
    return 0
