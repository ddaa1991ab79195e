"""A lone sequence's decode step with and without the folded inputs, alternated in ONE process.

    python -m bench.decode_fold_ab --rounds 12 --out bench/results/decode_fold_ab.json
    DUALPACE_CPU_KERNELS=avx2 python -m bench.decode_fold_ab --rounds 12

The one-region step of the CPU kernels reads DUALPACE_DECODE_FOLD at every call (cpu_kernels.cpp
fold_inputs): 1 (default) has every thread compute the norm / SiLU x up feeding its matrix chunks,
0 keeps them as single-task stages. Both run here on the same loaded model and KV cache, in
blocks of steps whose order flips every round, with the copy bandwidth taken at every round: on
a shared machine the two modes see the same minutes, which separate runs of bench.cpu_decode do
not. Reported per mode: median and fastest forward (PagedForward.forward_tensors, batch 1, the
model's bf16 weights, LM head included; no sampling) and the median forward against the weights
limit (weight bytes / the median round's copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from dualpace.kv.block_table import KVBlockManager
from dualpace.kv.storage import KVStorage
from dualpace.model.loader import load_model, weights_num_bytes
from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors
from toolkit.memory_bandwidth import copy_bandwidth_bytes_per_s

BLOCK_SIZE = 16
MODES = ("0", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode per round (after 2 untimed)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="bf16", weights="bf16")
    cfg, model = loaded.config, loaded.model
    weight_bytes = weights_num_bytes(model.weights)
    per_round = args.steps + 2
    blocks = KVBlockManager(-(-(args.context + per_round + 2) // BLOCK_SIZE), BLOCK_SIZE)
    kv = KVStorage(cfg.num_layers, blocks.num_total_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                   model.dtype, model.device)
    kv.k.normal_()
    kv.v.normal_()
    forward = PagedForward(model, kv)
    times_ms: dict[str, list[float]] = {m: [] for m in MODES}
    copy_gb_per_s: list[float] = []
    load_at_start = os.getloadavg()
    for r in range(args.rounds):
        copy_gb_per_s.append(copy_bandwidth_bytes_per_s(repeats=3) / 1e9)
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            os.environ["DUALPACE_DECODE_FOLD"] = mode
            blocks.allocate(0, args.context)
            num_tokens, token = args.context, 5
            for i in range(per_round):
                blocks.append(0, 1)
                step = build_step_tensors([SequenceWork([token], num_tokens, blocks.block_ids(0))], BLOCK_SIZE,
                                          model.device)
                start = time.perf_counter()
                logits = forward.forward_tensors(step)
                elapsed_ms = 1e3 * (time.perf_counter() - start)
                token = int(logits[0].float().argmax())
                num_tokens += 1
                if i >= 2:
                    times_ms[mode].append(elapsed_ms)
            blocks.free(0)
    limit_ms = 1e3 * weight_bytes / (statistics.median(copy_gb_per_s) * 1e9)
    result = {
        "model": args.model, "threads": args.threads, "context": args.context,
        "cpu_kernels": os.environ.get("DUALPACE_CPU_KERNELS", "default"), "weight_bytes": weight_bytes,
        "copy_gb_per_s": [round(b, 1) for b in copy_gb_per_s], "weights_limit_ms": round(limit_ms, 3),
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
    }
    for mode, values in times_ms.items():
        median_ms = statistics.median(values)
        result[f"fold{mode}"] = {"median_forward_ms": round(median_ms, 3), "fastest_forward_ms": round(min(values), 3),
                                 "median_forward_over_weights_limit": round(limit_ms / median_ms, 3),
                                 "steps": len(values)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
