"""A/B of the block-weight GEMV kernels in one process: activation modes of quant_gemv.h (default:
int16, the weights widened to int16, against int16-split, Q8_0's split-byte maddubs kernel) on one
thread, interleaved, min of N samples of the calling thread's CPU time (time it was preempted by
other work on a loaded machine left out).

    python -m bench.quant_gemv --format Q8_0 --shapes 576x1536,1536x576,49152x576 --batches 1,8
    python -m bench.quant_gemv --format Q4_K --shapes 576x1536 --modes int16,fp32   # K-quants too
    python -m bench.quant_gemv --format Q4_1 --modes avx2:int16,avx512_bf16:int16  # ISA variants

Shapes are N x K (output x input). Prints one line per shape x batch: microseconds per call for
each mode (preparing the activations included), the ratio, and weight GB/s of the faster one.

    python -m bench.quant_gemv --decode-model F.gguf --batches 1,8 --context 128

instead times whole decode steps (PagedForward, torch's threads) of a GGUF's native weights,
the modes alternating in the same process, min of N wall-clock steps.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import numpy as np
import torch
from gguf.quants import quantize

from dualpace.model import quant_kernels
from dualpace.model.quant import FORMAT_BY_NAME, QuantizedWeight


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        n, _, k = item.partition("x")
        if not (n.isdigit() and k.isdigit()) or int(n) == 0 or int(k) % 32:
            raise SystemExit(f"--shapes: {item!r} is not NxK with N > 0 and K a multiple of 32")
        shapes.append((int(n), int(k)))
    return shapes


# Byte offset of the fp16 super-block scale d in a K-quant block (Q4_K: d, dmin first; Q6_K: d last).
_K_QUANT_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def bench_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: quantized random weights where the gguf package has a quantizer, else
    (K-quants) random bytes whose fp16 scales are set small and finite (speed does not depend on
    the values)."""
    fmt = FORMAT_BY_NAME[name]
    if name not in _K_QUANT_SCALE_OFFSETS:
        return np.asarray(quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, fmt.ggml_type)).reshape(n, -1)
    if k % fmt.block_elems:
        raise SystemExit(f"--shapes: K = {k} is not a multiple of {name}'s {fmt.block_elems}")
    blocks = rng.integers(0, 256, (n * k // fmt.block_elems, fmt.block_bytes), dtype=np.uint8)
    scales = np.full(blocks.shape[0], 0.004, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for offset in _K_QUANT_SCALE_OFFSETS[name]:
        blocks[:, offset:offset + 2] = scales
    return blocks.reshape(n, -1)


_foreign: dict[str, ctypes.CDLL] = {}


def arm_label(arm: str) -> str:
    """The arm as results name it: a library built elsewhere by its file name only."""
    variant, _, mode = arm.rpartition(":")
    return f"{os.path.basename(variant)}:{mode}" if variant.endswith(".so") else arm


def arm_library(arm: str) -> tuple[ctypes.CDLL, str]:
    """An arm `MODE` (the library in use) or `VARIANT:MODE` (the library built for that ISA variant,
    e.g. avx2:int16 against avx512_bf16:int16): the library, with the arm's mode set in it."""
    variant, _, mode = arm.rpartition(":")
    if variant.endswith(".so"):  # a library built elsewhere (e.g. another commit's sources)
        lib = _foreign.get(variant) or _foreign.setdefault(variant, ctypes.CDLL(variant))
        lib.dp_quant_set_activations.argtypes, lib.dp_quant_linear.restype = [ctypes.c_int32], ctypes.c_int
        lib.dp_quant_linear.argtypes = quant_kernels._SIGNATURES["dp_quant_linear"][0]
        lib.dp_quant_set_activations(quant_kernels.ACTIVATION_MODES[mode])
        return lib, mode
    lib = quant_kernels.load_variant(variant) if variant else quant_kernels.get()
    if lib is None:
        raise SystemExit(f"{arm}: the kernels of variant {variant!r} did not build or load here")
    lib.dp_quant_set_activations(quant_kernels.ACTIVATION_MODES[mode])
    return lib, mode


def call_seconds(qw: QuantizedWeight, x: torch.Tensor, y: torch.Tensor, calls: int, lib=None) -> float:
    """Seconds per dp_quant_linear call (straight through ctypes: no Python-side allocation)."""
    lib, desc = lib or quant_kernels.get(), ctypes.byref(qw.segments[0].desc)
    x_ptr, y_ptr, m = x.data_ptr(), y.data_ptr(), x.shape[0]
    start = time.thread_time()
    for _ in range(calls):
        lib.dp_quant_linear(desc, x_ptr, m, qw.k, y_ptr, qw.n)
    return (time.thread_time() - start) / calls


def measure(qw: QuantizedWeight, m: int, modes: list[str], rounds: int, budget_s: float) -> dict[str, float]:
    x, y = torch.randn(m, qw.k), torch.empty(m, qw.n)
    calls = max(1, int(budget_s / max(call_seconds(qw, x, y, 3, arm_library(modes[0])[0]), 1e-6)))
    best = {mode: float("inf") for mode in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:  # interleaved, order alternating
            lib, _ = arm_library(mode)
            best[mode] = min(best[mode], call_seconds(qw, x, y, calls, lib))
    quant_kernels.set_activations("int16")
    return best


def decode_steps(model: str, batches: list[int], context: int, modes: list[str], rounds: int) -> list[dict]:
    from dualpace.kv.storage import KVStorage
    from dualpace.model.loader import load_model
    from dualpace.model.paged_forward import PagedForward, SequenceWork

    loaded = load_model(model, dtype="fp32", weights="native")
    cfg, block = loaded.config, 16
    rows = []
    for m in batches:
        per_seq = -(-(context + 1) // block)
        kv = KVStorage(cfg.num_layers, m * per_seq, block, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        kv.k.normal_()
        kv.v.normal_()
        work = [SequenceWork([100 + i], context, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(m)]
        forward = PagedForward(loaded.model, kv)
        best = {mode: float("inf") for mode in modes}
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                quant_kernels.set_activations(mode)
                forward.forward(work)  # warm
                for _ in range(3):
                    start = time.perf_counter()
                    forward.forward(work)
                    best[mode] = min(best[mode], time.perf_counter() - start)
        quant_kernels.set_activations("int16")
        cells = "  ".join(f"{mode} {best[mode] * 1e3:7.2f} ms ({best[modes[0]] / best[mode]:.2f}x)" for mode in modes)
        print(f"decode step, batch {m:>3}, context {context}: {cells}")
        rows.append({"batch": m, "context": context, "seconds": best})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="Q8_0", choices=sorted(FORMAT_BY_NAME))
    parser.add_argument("--shapes", default="576x1536,1536x576,49152x576")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="int16,int16-split",
                        help="activation modes to compare (first: base); VARIANT:MODE (avx2:int16) "
                             "uses the library built for that ISA variant, LIB.so:MODE a library built elsewhere")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--budget-ms", type=float, default=20.0, help="time per sample")
    parser.add_argument("--decode-model", help="time decode steps of this GGUF instead (native weights)")
    parser.add_argument("--context", type=int, default=128, help="with --decode-model: tokens in each KV")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if quant_kernels.get() is None:
        raise SystemExit("the quantized-weight kernels are not built here")
    modes = args.modes.split(",")
    for mode in modes:
        variant, _, name = mode.rpartition(":")
        known = not variant or variant.endswith(".so") or variant in quant_kernels.kbuild.VARIANTS
        if name not in quant_kernels.ACTIVATION_MODES or not known:
            raise SystemExit(f"--modes: unknown mode {mode!r}")
    if args.decode_model and any(":" in mode for mode in modes):
        raise SystemExit("--decode-model compares modes of one library (VARIANT:MODE arms are for the GEMV)")
    batches = [int(b) for b in args.batches.split(",")]
    if args.decode_model:
        print(f"load average {os.getloadavg()[0]:.2f}; {torch.get_num_threads()} threads; min of {args.rounds * 3}")
        rows = decode_steps(args.decode_model, batches, args.context, modes, args.rounds)
        print(f"load average {os.getloadavg()[0]:.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": os.path.basename(args.decode_model), "modes": modes, "rows": rows}, f, indent=1)
        return 0
    torch.set_num_threads(1)
    fmt = FORMAT_BY_NAME[args.format]
    rng = np.random.default_rng(0)
    rows = []
    print(f"load average {os.getloadavg()[0]:.2f}; one thread; {args.format}; min of {args.rounds}")
    for n, k in parse_shapes(args.shapes):
        qw = QuantizedWeight.from_blocks(bench_blocks(args.format, n, k, rng), fmt, k)
        for m in batches:
            best = measure(qw, m, modes, args.rounds, args.budget_ms / 1e3)
            base = best[modes[0]]
            cells = "  ".join(f"{arm_label(mode)} {best[mode] * 1e6:9.1f} us ({base / best[mode]:.2f}x)"
                              for mode in modes)
            gbps = qw.num_bytes() / min(best.values()) / 1e9
            print(f"{n:>6}x{k:<5} batch {m:>3}  {cells}  {gbps:5.1f} GB/s")
            rows.append({"n": n, "k": k, "batch": m, "seconds": {arm_label(a): t for a, t in best.items()}})
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"format": args.format, "modes": [arm_label(a) for a in modes], "rounds": args.rounds,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
