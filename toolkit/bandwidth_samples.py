"""Distribution of this machine's memory bandwidths over a while, one and two threads, to tell a
rare high copy-bandwidth reading (bench/cpu_decode.py's limit, best of a few) from an artefact.

    python -m toolkit.bandwidth_samples 120      # seconds of sampling

Each sample is the best of 4 over a 512 MiB buffer of random values: copy (read + written bytes,
as toolkit/memory_bandwidth.py counts it), read (sum), fill (written bytes), with two threads,
then copy and read with one. Prints max / p90 / median per kind and the load average at the end.
"""

from __future__ import annotations

import os
import sys
import time

import torch

NUM_BYTES = 512 * 2**20


def best_s(fn, repeats: int = 4) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(seconds: float) -> None:
    src = torch.rand(NUM_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples: dict[str, list[float]] = {"copy_rw": [], "read": [], "fill": [], "copy_rw_1t": [], "read_1t": []}
    end = time.time() + seconds
    while time.time() < end:
        torch.set_num_threads(2)
        samples["copy_rw"].append(2 * NUM_BYTES / best_s(lambda: dst.copy_(src)) / 1e9)
        samples["read"].append(NUM_BYTES / best_s(lambda: src.sum()) / 1e9)
        samples["fill"].append(NUM_BYTES / best_s(lambda: dst.fill_(1.0)) / 1e9)
        torch.set_num_threads(1)
        samples["copy_rw_1t"].append(2 * NUM_BYTES / best_s(lambda: dst.copy_(src)) / 1e9)
        samples["read_1t"].append(NUM_BYTES / best_s(lambda: src.sum()) / 1e9)
    for name, values in samples.items():
        values = sorted(values)
        print(f"{name} GB/s: n {len(values)} max {values[-1]:.1f} p90 {values[int(0.9 * (len(values) - 1))]:.1f} "
              f"median {values[len(values) // 2]:.1f}")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
