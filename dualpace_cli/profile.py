"""`dualpace profile`: measure this machine for a model (the tables of dualpace.profile.schema) and
store the profile under profiles/local/, or reuse a stored one whose fingerprints match."""

from __future__ import annotations

import argparse
from pathlib import Path

from dualpace.errors import InvalidArgument
from dualpace.model.registry import DEFAULT_MODEL_NAME


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InvalidArgument(flag, f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise InvalidArgument(flag, f"expected strictly increasing positive integers, got {text!r}")
    return values


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure this machine for a model (or reuse a matching stored profile)")
    p.add_argument("--model", default=DEFAULT_MODEL_NAME, help="known name, Hugging Face folder or .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for the measurements and the gpu_service it starts (default: half the cores)")
    p.add_argument("--device", default="auto", help="where the GPU engine runs: auto, cuda or cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a tiny grid with few repeats (tests, smoke checks)")
    p.add_argument("--prefill-tokens", help="grid, e.g. 16,64,256,1024")
    p.add_argument("--batch", help="grid, e.g. 1,2,4,8,16,32")
    p.add_argument("--context-tokens", help="grid, e.g. 32,256,1024,2048")
    p.add_argument("--kv-transfer-tokens", help="grid, e.g. 64,512,2048")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per point")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point (the median is stored)")
    p.add_argument("--statistic", choices=("median", "min"), default=None,
                   help="what a table stores of each point's repeats (default median; min on a machine "
                        "shared with other work: interference only ever adds time)")
    p.add_argument("--gpu-kv-blocks", type=int, default=None, help="capacity override (default: from memory)")
    p.add_argument("--cpu-kv-blocks", type=int, default=None, help="capacity override (default: from memory)")
    p.add_argument("--out", type=Path, default=None,
                   help="profile JSON path (default profiles/local/<model>-<dtype>-<cpu>-<cores>c-t<threads>-<device>.json)")
    p.add_argument("--force", action="store_true", help="measure even when a stored profile matches")
    p.add_argument("--notes", default="", help="free text stored in the profile (e.g. 'machine shared, noisy')")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from profiles.profiler.run import (
        DEFAULT_GRIDS,
        QUICK_GRIDS,
        ProfileRequest,
        default_threads,
        headline,
        run_profile,
    )

    grids = QUICK_GRIDS if args.quick else DEFAULT_GRIDS
    for flag in ("prefill_tokens", "batch", "context_tokens", "kv_transfer_tokens"):
        text = getattr(args, flag)
        if text is not None:
            grids = replace(grids, **{flag: _int_list(text, "--" + flag.replace("_", "-"))})
    for flag, minimum in (("warmup", 0), ("repeats", 1)):
        value = getattr(args, flag)
        if value is not None:
            if value < minimum:
                raise InvalidArgument(f"--{flag}", f"must be >= {minimum}, got {value}")
            grids = replace(grids, **{flag: value})
    if args.statistic is not None:
        grids = replace(grids, statistic=args.statistic)
    threads = default_threads() if args.threads is None else args.threads
    for flag, value in (("--threads", threads), ("--block-size", args.block_size)):
        if value < 1:
            raise InvalidArgument(flag, f"must be >= 1, got {value}")
    path, profile, reused = run_profile(ProfileRequest(
        model=args.model, dtype=args.dtype, threads=threads, block_size=args.block_size, device=args.device,
        grids=grids, out=args.out, force=args.force, gpu_kv_blocks=args.gpu_kv_blocks,
        cpu_kv_blocks=args.cpu_kv_blocks, progress=not args.no_progress, notes=args.notes))
    if not reused:
        meta = profile.profiler or {}
        print(f"wrote {path} and {path.with_suffix('.png')} in {meta.get('duration_s')} s "
              f"(median spread of repeats {meta.get('median_spread')}, load average {meta.get('load_average_1m')}; "
              f"cost-model fit error vs whole iterations: Local {meta.get('local_fit', {}).get('mean_relative_error')}, "
              f"Assisted {meta.get('assisted_fit', {}).get('mean_relative_error')})")
    for line in headline(profile):
        print("  " + line)
    return 0
