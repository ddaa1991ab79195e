"""The sender's fused copy + CRC32C and the target's verify pass alone, in one process, one thread.

Pools of the default model's shape (30 layers, 3 KV heads x 64, bf16: 384 bytes per token per
layer for K and as much for V), the source a private pool of `--tokens` tokens, the target a
memfd-backed pool of `--target-slots` slots (as SharedKvMemory makes it, pages faulted in first),
the transfer's slots (the first `--tokens` of a source pool of `--source-tokens`) contiguous on
both sides unless `--scatter` (blocks of 16 in reverse order on the target). Each figure is the median of `--repeats`, "warm" back to back, "cold" after
`--idle-s` of sleep (the bench's settle time) with the caches' share of the pools evicted by a
64 MiB sweep ("slept": sleep only, "swept": sweep only). The reference is numpy's copy of the same
runs (one thread); `copy_then_verify` is the fused copy followed at once by the target's verify pass.
`--stream 1`: the copy's non-temporal stores.

    python -m bench.kv_shm_copy_micro --repeats 20
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import statistics
import time

import numpy as np

from dualpace.engine.transfer import kv_copy_native

LAYERS, SLOT_BYTES, BLOCK = 30, 3 * 64 * 2, 16


def pools(tokens: int, target_slots: int):
    rng = np.random.default_rng(0)
    src_k = rng.integers(0, 256, (LAYERS, tokens * SLOT_BYTES), dtype=np.uint8)
    src_v = rng.integers(0, 256, (LAYERS, tokens * SLOT_BYTES), dtype=np.uint8)
    if target_slots < tokens:
        raise SystemExit("--target-slots below --source-tokens")
    per_pool = LAYERS * target_slots * SLOT_BYTES
    fd = os.memfd_create("kv-micro", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * per_pool)
    buffer = mmap.mmap(fd, 2 * per_pool, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    whole = np.frombuffer(buffer, dtype=np.uint8)
    whole[:] = 0  # faulted in, as shm_populate does in the background
    dst_k = whole[:per_pool].reshape(LAYERS, -1)
    dst_v = whole[per_pool:].reshape(LAYERS, -1)
    return src_k, src_v, dst_k, dst_v, (fd, buffer)


def runs_for(tokens: int, scatter: bool) -> np.ndarray:
    if not scatter:
        return np.array([[0, 0, tokens]], dtype=np.int64)
    blocks = tokens // BLOCK
    return np.array([[b * BLOCK, (blocks - 1 - b) * BLOCK, BLOCK] for b in range(blocks)], dtype=np.int64)


def timed(fn, repeats: int, idle_s: float, sweep: np.ndarray | None) -> float:
    times = []
    fn()
    for _ in range(repeats):
        if sweep is not None:
            sweep += 1  # read + write 64 MiB: the pools' lines leave L2 (and some of L3's share)
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--source-tokens", type=int, default=0,
                        help="the source pool's size (default --tokens; the benches' pool is their largest size)")
    parser.add_argument("--target-slots", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=0.3)
    parser.add_argument("--scatter", action="store_true")
    parser.add_argument("--states", default="warm,cold", help="of warm, cold (idle + sweep), slept, swept")
    parser.add_argument("--stream", type=int, default=0, help="1: the fused copy's non-temporal stores")
    parser.add_argument("--threads", type=int, default=1, help="the fused copy's layers split over N threads")
    parser.add_argument("--only", default="", help="comma list of figures to time (default all)")
    args = parser.parse_args()
    lib = kv_copy_native.get()
    src_k, src_v, dst_k, dst_v, _keep = pools(max(args.tokens, args.source_tokens), args.target_slots)
    runs = runs_for(args.tokens, args.scatter)
    out = np.zeros(LAYERS, dtype=np.uint32)
    nbytes = 2 * LAYERS * args.tokens * SLOT_BYTES

    def numpy_copy():
        for layer in range(LAYERS):
            for s, d, n in runs:
                for src, dst in ((src_k, dst_k), (src_v, dst_v)):
                    np.copyto(dst[layer, d * SLOT_BYTES:(d + n) * SLOT_BYTES], src[layer, s * SLOT_BYTES:(s + n) * SLOT_BYTES])

    executor = concurrent.futures.ThreadPoolExecutor(args.threads)
    parts = [range(LAYERS * i // args.threads, LAYERS * (i + 1) // args.threads) for i in range(args.threads)]

    def fused_part(layers: range, dst: bool):
        sk, sv = src_k[layers.start], src_v[layers.start]
        dk, dv = dst_k[layers.start], dst_v[layers.start]
        lib.dp_kv_layers_copy_crc32c(dk.ctypes.data if dst else None, dv.ctypes.data if dst else None,
                                     sk.ctypes.data, sv.ctypes.data, src_k.strides[0], dst_k.strides[0],
                                     len(layers), runs.ctypes.data, len(runs), SLOT_BYTES,
                                     out[layers.start:].ctypes.data, args.stream)

    def fused(dst=True):
        if args.threads == 1:
            return fused_part(range(LAYERS), dst)
        list(executor.map(fused_part, parts, [dst] * len(parts)))

    def verify():  # the target's pass: CRC of its own blocks, no store
        lib.dp_kv_layers_copy_crc32c(None, None, dst_k.ctypes.data, dst_v.ctypes.data, dst_k.strides[0],
                                     dst_k.strides[0], LAYERS, runs[:, [1, 1, 2]].copy().ctypes.data, len(runs),
                                     SLOT_BYTES, out.ctypes.data, 0)

    def copy_then_verify():
        fused()
        verify()

    figures = {"copy_then_verify": copy_then_verify, "numpy_copy": numpy_copy, "fused_copy_crc": fused, "crc_source_only": lambda: fused(False),
               "verify": verify}
    only = [f for f in args.only.split(",") if f] or list(figures)
    sweep = np.zeros(64 * 2**20, dtype=np.uint8)
    result = {"tokens": args.tokens, "bytes": nbytes, "scatter": args.scatter, "threads": args.threads,
              "stream": args.stream, "crc_path": kv_copy_native.crc_path()}
    for name in only:
        states = {"warm": (0.0, None), "cold": (args.idle_s, sweep), "slept": (args.idle_s, None), "swept": (0.0, sweep)}
        for state in args.states.split(","):
            ms = timed(figures[name], args.repeats, *states[state])
            result[f"{name}_{state}_ms"] = round(ms, 3)
            result[f"{name}_{state}_gbps"] = round(nbytes / ms / 1e6, 2)
    result["load_average"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
