"""`dualpace model`: synthetic checkpoints (`synth`) and the list of presets (`presets`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dualpace.errors import InvalidArgument

_DTYPE_CHOICES = ("fp32", "bf16")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `model synth` and `model presets` to the top-level parser."""
    parser = subparsers.add_parser("model", help="model utilities (synthetic checkpoints)")
    actions = parser.add_subparsers(dest="model_command", required=True, metavar="{synth,presets,export}")

    synth = actions.add_parser("synth", help="write a random-weight Hugging Face checkpoint of a preset")
    synth.add_argument("--preset", required=True, help="preset name (see `dualpace model presets`)")
    synth.add_argument("--out", required=True, type=Path, help="output folder (created; must be empty)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--dtype", help="fp32 or bf16 (default: fp32 for tiny presets, bf16 for large)")
    synth.add_argument("--max-shard-mb", type=float, help="split weights into shards of at most this size")
    synth.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing weights")

    actions.add_parser("presets", help="list the synthetic checkpoint presets")

    export = actions.add_parser("export", help="write a GGUF model (e.g. the default) as a Hugging Face folder")
    export.add_argument("--model", default="smollm2-135m",
                        help="known name or .gguf file (with --gguf, also a Hugging Face folder)")
    export.add_argument("--out", required=True, type=Path, help="output folder (created; must be empty)")
    export.add_argument("--dtype", default="fp32", choices=_DTYPE_CHOICES)
    export.add_argument("--tokenizer-only", action="store_true",
                        help="no weights: tokenizer.json, tokenizer_config.json (chat template), config.json — "
                             "the folder Dynamo's frontend tokenizes from (docs/scale-out.md)")
    export.add_argument("--gguf", choices=["q8_0", "f32", "f16", "bf16"],
                        help="write a .gguf file (--out) with every matrix in this format (re-quantized from a "
                             ".gguf, or converted from a Hugging Face folder; dense f32/f16/bf16 e.g. for "
                             "llama.cpp's llama-quantize) instead")


def run(args: argparse.Namespace) -> int:
    if args.model_command == "synth":
        return _run_synth(args)
    if args.model_command == "export":
        return _run_export(args)
    return _run_presets()


def _run_export(args: argparse.Namespace) -> int:
    import torch

    from dualpace.model.export import export_hf_folder

    if args.gguf is not None:
        from dualpace.model.gguf_requant import requantize_gguf

        print(requantize_gguf(args.model, args.out, args.gguf))
        return 0
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(export_hf_folder(args.model, args.out, dtype, tokenizer_only=args.tokenizer_only))
    return 0


def _run_synth(args: argparse.Namespace) -> int:
    import torch  # deferred: keeps `dualpace --help` fast

    from dualpace.model.synth import DEFAULT_MAX_SHARD_BYTES, get_preset, write_synthetic_checkpoint

    get_preset(args.preset)  # an unknown name fails before anything else is checked
    if args.dtype is not None and args.dtype not in _DTYPE_CHOICES:
        raise InvalidArgument("--dtype", f"must be one of {', '.join(_DTYPE_CHOICES)}, got {args.dtype!r}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[args.dtype]
    if args.max_shard_mb is not None and args.max_shard_mb <= 0:
        raise InvalidArgument("--max-shard-mb", f"must be positive, got {args.max_shard_mb}")
    max_shard_bytes = DEFAULT_MAX_SHARD_BYTES if args.max_shard_mb is None else int(args.max_shard_mb * 1e6)
    out_dir = write_synthetic_checkpoint(
        args.preset, args.out, seed=args.seed, dtype=dtype, force=args.force, max_shard_bytes=max_shard_bytes
    )
    print(out_dir)
    return 0


def _run_presets() -> int:
    import torch

    from dualpace.model.synth import PRESETS, count_parameters

    dtype_names = {torch.float32: "fp32", torch.bfloat16: "bf16"}

    rows = [("name", "arch", "params", "dtype", "description")]
    for preset in PRESETS.values():
        num_params = count_parameters(preset.config)
        params = f"{num_params / 1e9:.2f}B" if num_params >= 1e8 else f"{num_params / 1e3:.0f}K"
        dtype = dtype_names.get(preset.default_dtype, str(preset.default_dtype))
        rows.append((preset.name, preset.config.architecture, params, dtype, preset.description))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return 0
