"""Copy bandwidth of this machine, measured with torch, as the physical limit for decode."""

from __future__ import annotations

import time

import torch


def copy_bandwidth_bytes_per_s(num_bytes: int = 512 * 2**20, repeats: int = 8, random: bool = False) -> float:
    """Best-of-`repeats` bandwidth of a large tensor copy, counting bytes read plus bytes written
    (as STREAM's copy kernel counts it); of ones, or of
    random values (`random`, to rule out a memory system that gains from uniform data)."""
    src = torch.rand(num_bytes // 4) if random else torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best_s = min(best_s, time.perf_counter() - start)
    return 2 * num_bytes / best_s


def read_bandwidth_bytes_per_s(num_bytes: int = 512 * 2**20, repeats: int = 8) -> float:
    """Best-of-`repeats` bandwidth of summing a large tensor: bytes read only, the access
    pattern of a decode step streaming its weights."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        best_s = min(best_s, time.perf_counter() - start)
    return num_bytes / best_s


if __name__ == "__main__":
    print(f"copy bandwidth: {copy_bandwidth_bytes_per_s() / 1e9:.1f} GB/s (read + write), "
          f"read bandwidth: {read_bandwidth_bytes_per_s() / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
