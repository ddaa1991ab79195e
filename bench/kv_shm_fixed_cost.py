"""The fixed cost of a same-host KV transfer: small shm transfers only, more repeats than data_plane.

bench.data_plane's fit over 64..1024 tokens gives the fixed cost as an intercept, which on a
loaded machine moves by several ms with the noise of its large points. Here only small
transfers are timed (default 16 and 64 tokens of the default model: 0.7 and 2.9 MB), with
bench.data_plane's own target, source pool and timing (header to commit, one warm-up per size,
the same settle time), and the sender's phases (`SameHostKvSender.phase_ms`) are reported.

    python -m bench.kv_shm_fixed_cost --repeats 15

The last output line is one JSON object: median and lower-quartile ms per size, phase medians,
and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics

from bench.data_plane import phase_medians, source_pool, time_shm_transfers
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.wire.engine_messages import info_request_to_pb
from toolkit.engine_client import EngineClient
from toolkit.processes import start_daemon


def start_target(model: str, sizes: list[int], name: str, *extra: str):
    """The target cpu_service of these benches: one thread, room for a few of the largest transfers."""
    return start_daemon("cpu_service", "--model", model, "--dtype", "auto", "--threads", "1",
                        "--name", name, "--kv-blocks", str(4 * (max(sizes) // 16 + 2)),
                        "--block-size", "16", "--assist", "never", *extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--sizes", default="16,64", help="token counts of the transfers timed")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--settle-s", type=float, default=0.3)
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if args.repeats < 4:
        parser.error("--repeats must be at least 4 (quartiles are reported)")
    load_before = os.getloadavg()
    target = start_target(args.model, sizes, "fixed-cost-target")
    try:
        info = EngineClient(target.address).stub.Info(info_request_to_pb(), timeout=10)
        storage = source_pool(info, max(sizes))

        times, sender = asyncio.run(time_shm_transfers(target.address, storage, info, sizes, args.repeats,
                                                       args.settle_s))
    finally:
        target.stop()
    result = {
        "median_ms": {str(n): round(statistics.median(t), 3) for n, t in times.items()},
        "p25_ms": {str(n): round(statistics.quantiles(t, n=4)[0], 3) for n, t in times.items()},
        "phase_ms_median": phase_medians(sender),
        "load_average_before_after": [load_before, os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
