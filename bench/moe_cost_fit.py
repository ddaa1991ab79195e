"""How well the cost model prices a mixture-of-experts CPU step.

Local decode iterations of the CPU engine's runner (short context, so the step is the weights'
reads) are measured at the batches of a grid (default: the profiler's, DEFAULT_GRIDS) and at
batches between them. The grid's times make the cpu_dense_ms table of a profile whose model
fingerprint carries the weights' MoE bytes (dualpace.model.loader.moe_weight_bytes); the
between-batches are then predicted by the real CostModel (its fit of const + a * bytes read +
b * rows, dualpace.profile.moe_step_fit) and, for comparison, along the batch (how a dense model's
table is read). Reported: each prediction's error against the measurement, and the fit.

    python -m bench.moe_cost_fit --model Q8_0.gguf --check 3,6,12,24,48
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

import torch

from dualpace.model.loader import load_model, moe_weight_bytes
from dualpace.model.moe_spec import expected_distinct_experts
from dualpace.profile.cost_model import CostModel, interp1d
from dualpace.profile.fingerprint import model_fingerprint
from dualpace.profile.schema import PROFILE_VERSION, Capacities, HardwareFingerprint, KVTransfer, Profile, Table1D
from profiles.profiler.measure import RunnerBench, blocks_needed
from profiles.profiler.run import DEFAULT_GRIDS
from profiles.profiler.timing import measure

BLOCK_SIZE = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a mixture-of-experts model (folder or GGUF)")
    parser.add_argument("--weights", default="native")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", default=",".join(map(str, DEFAULT_GRIDS.batch)),
                        help="batches of the profile's table (default: the profiler's)")
    parser.add_argument("--check", default="3,6,12,24,48", help="batches predicted from the table and measured")
    parser.add_argument("--context", type=int, default=32, help="KV tokens per sequence")
    parser.add_argument("--repeats", type=int, default=7, help="rounds over every batch")
    parser.add_argument("--statistic", choices=("median", "min"), default="median",
                        help="what a batch's time is of its rounds (min on a busy machine)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = [int(b) for b in args.grid.split(",")]
    checks = [int(b) for b in args.check.split(",")]
    loaded = load_model(args.model, dtype=args.dtype, weights=args.weights)
    moe = moe_weight_bytes(loaded.model.weights, loaded.config)
    if moe is None:
        parser.error(f"{args.model} is not a mixture-of-experts model")
    bench = RunnerBench(loaded, max(grid + checks) * blocks_needed(args.context, BLOCK_SIZE), BLOCK_SIZE)
    load_at_start = list(os.getloadavg())

    # rounds of one timed step per batch (after one warm-up), so a change of load reaches every batch alike
    batches = sorted(set(grid + checks))
    steps = {b: bench.iteration(bench.decode_plan(b, args.context)) for b in batches}
    times: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(args.repeats):
        for b in batches:
            times[b].append(measure(steps[b], 1, 1).median_ms)
    pick = min if args.statistic == "min" else statistics.median
    measured = {b: pick(times[b]) for b in batches}
    model = model_fingerprint(loaded.config, loaded.model.dtype, BLOCK_SIZE)
    table = Table1D("batch", tuple(grid), tuple(measured[b] for b in grid))
    profile = Profile(PROFILE_VERSION, HardwareFingerprint("bench", 1, 1), replace(model, moe=moe),
                      {"cpu_dense_ms": table}, KVTransfer(1.0, 0.0), Capacities(1, 1, 1))
    cost = CostModel(profile)
    rows = []
    for b in checks:
        by_bytes, by_batch = cost.cpu_dense_ms(b), interp1d(grid, [measured[g] for g in grid], b)
        rows.append({"batch": b, "measured_ms": round(measured[b], 2), "cost_model_ms": round(by_bytes, 2),
                     "cost_model_error": round(by_bytes / measured[b] - 1, 3), "along_batch_ms": round(by_batch, 2),
                     "along_batch_error": round(by_batch / measured[b] - 1, 3),
                     "expected_distinct_experts": expected_distinct_experts(moe.num_experts,
                                                                            moe.num_experts_per_tok, b)})
    result = {"model": os.path.basename(args.model), "weights": args.weights, "threads": args.threads,
              "context": args.context, "statistic": args.statistic, "repeats": args.repeats,
              "active_bytes_per_token": moe.active_bytes_per_token(), "moe": vars(moe), "grid": grid,
              "fit": {"const_ms": cost.moe_step_fit.const_ms, "ms_per_mb": cost.moe_step_fit.ms_per_byte * 1e6,
                      "ms_per_row": cost.moe_step_fit.ms_per_row},
              "measured_ms": {str(b): round(ms, 2) for b, ms in measured.items()}, "rows": rows,
              "load_average": {"start": load_at_start, "end": list(os.getloadavg())}}
    print("| batch | measured ms | cost model ms (error) | along the batch ms (error) | distinct experts/layer |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['measured_ms']} | {r['cost_model_ms']} ({r['cost_model_error']:+.0%}) | "
              f"{r['along_batch_ms']} ({r['along_batch_error']:+.0%}) | {r['expected_distinct_experts']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("active_bytes_per_token", "fit", "load_average")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
