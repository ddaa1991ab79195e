"""One batch-1 pass of the default model's layer matrices (bf16, 30 x qkv/o/gate_up/down = 212 MB)
through the kernels' GEMV, per ISA variant, interleaved with the copy and read bandwidths that
bench/cpu_decode.py takes as the physical limit, in rounds (a shared machine is noisy: compare
within a round).

    python -m bench.bf16_gemv_pass --variants avx2,avx512_bf16 --rounds 5 --out bench/results/x.json

Per round and variant: best of --passes passes (each pass: every matrix once, one Python call per
matrix, so ~120 calls of overhead are included), in weight GB/s read. Per round also the copy
bandwidth (read + written bytes of a 512 MiB copy, of ones as toolkit/memory_bandwidth.py and of
random values), and the read bandwidth (sum of 512 MiB). GEMV_PASS_LAYERS=2: a pass that fits in
L3; GEMV_PASS_HUGE=1: the matrices copied into one MADV_HUGEPAGE buffer first.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import torch

from dualpace.model import cpu_kernels
from dualpace.model.cpu_kernels_abi import SIGNATURES
from toolkit.memory_bandwidth import copy_bandwidth_bytes_per_s, read_bandwidth_bytes_per_s

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query heads and 3 kv heads of 64
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = int(os.environ.get("GEMV_PASS_LAYERS", "30"))  # fewer: the pass fits in the caches


def huge_page_copies(tensors: list) -> list:
    """The tensors copied into one 2 MiB-aligned buffer advised MADV_HUGEPAGE before first touch."""
    total = sum(-(-t.numel() * t.element_size() // 4096) * 4096 for t in tensors)
    raw = torch.empty(total + (2 << 20), dtype=torch.uint8)
    offset = -raw.data_ptr() % (2 << 20)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(raw.data_ptr() + offset, total, 14) != 0:  # MADV_HUGEPAGE
        raise OSError(ctypes.get_errno(), "madvise")
    out = []
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        view = raw[offset:offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += -(-nbytes // 4096) * 4096
    return out


def load_library(variant: str, path: str):
    """Kernels of a library built outside the cache (an experiment's -D flags)."""
    lib = ctypes.CDLL(path)
    for fn_name, (argtypes, restype) in SIGNATURES.items():
        getattr(lib, fn_name).argtypes = argtypes
        getattr(lib, fn_name).restype = restype
    return cpu_kernels.Kernels(lib, variant)


def gemv_pass_s(kernels, xs: dict, matrices: list, passes: int) -> float:
    best_s = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for w in matrices:
            kernels.linear(xs[w.shape[1]], w)
        best_s = min(best_s, time.perf_counter() - start)
    return best_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="avx2,avx512_bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    matrices = [torch.randn(n, k).mul_(0.05).to(torch.bfloat16) for _ in range(LAYERS) for n, k in SHAPES]
    if os.environ.get("GEMV_PASS_HUGE") == "1":
        matrices = huge_page_copies(matrices)
    weight_bytes = sum(w.numel() * 2 for w in matrices)
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
    variants = {}
    for item in args.variants.split(","):  # a variant, label=variant, or label=variant:path of a library built by hand
        label, _, spec = item.partition("=")  # or label=variant (the cached build)
        spec = spec or label
        variants[label] = load_library(*spec.split(":", 1)) if ":" in spec else cpu_kernels.load_variant(spec)
    for name, kernels in variants.items():
        gemv_pass_s(kernels, xs, matrices, 2)  # warm up
    rounds = []
    for _ in range(args.rounds):
        row = {"load_average": [round(v, 2) for v in os.getloadavg()],
               "copy_ones_gb_per_s": round(copy_bandwidth_bytes_per_s(repeats=6) / 1e9, 1),
               "copy_random_gb_per_s": round(copy_bandwidth_bytes_per_s(repeats=6, random=True) / 1e9, 1),
               "read_gb_per_s": round(read_bandwidth_bytes_per_s() / 1e9, 1)}
        for name, kernels in variants.items():
            row[f"{name}_gemv_gb_per_s"] = round(weight_bytes / gemv_pass_s(kernels, xs, matrices, args.passes) / 1e9, 1)
        rounds.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        result = {"weight_bytes": weight_bytes, "threads": torch.get_num_threads(), "passes": args.passes,
                  "cpu_flags": cpu_kernels.kernel_info()["cpu_flags"], "rounds": rounds}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
