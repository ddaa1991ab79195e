"""`dualpace generate`: single-process generation with the model core, paged KV and sampler."""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys

from dualpace.errors import InvalidArgument
from dualpace.model.quant_kernels import add_quant_activations_argument, use_config_activations
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text in this process (no daemons)")
    p.add_argument("--model", default=DEFAULT_MODEL_NAME, help="known name, Hugging Face folder or .gguf file")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt as a user message")
    p.add_argument("--batch", type=int, default=1, help="decode N distinct prompts together (the prompt + N-1 seeded variants)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--weights", default="native", choices=["native", "bf16", "fp32", "int8"], help="native: a GGUF's quantized matrices stay in their block format (default); bf16/fp32: dequantized at load; int8: quantized at load to Q8_0 (per group of 32)")
    add_quant_activations_argument(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--json", action="store_true", help="one JSON object per sequence, one per line")
    p.add_argument("--log-level", default="INFO",
                   help="dualpace's own log lines on stderr (INFO: the CPU kernel variant, the --dtype auto "
                        "decision, the weights' host memory; WARNING hides them); other libraries log warnings only")


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidArgument("--prompt-ids", f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise InvalidArgument("--prompt-ids", "no token ids given")
    return ids


def batch_variants(prompt_ids: list[int], batch: int, seed: int) -> list[list[int]]:
    """The prompt plus batch-1 variants: each appends 1-8 tokens drawn from the prompt itself,
    so the variants are distinct, of different lengths, and stay in-vocabulary."""
    rng = random.Random(seed)
    prompts = [list(prompt_ids)]
    for _ in range(batch - 1):
        prompts.append(list(prompt_ids) + [rng.choice(prompt_ids) for _ in range(rng.randint(1, 8))])
    return prompts


def configure_cli_logging(level: str) -> None:
    """The daemons' log lines (JSON on a pipe, readable on a terminal) on stderr: dualpace's own
    loggers at `level`, other libraries' at WARNING."""
    from dualpace.serve.logging_setup import configure_logging, parse_level

    dualpace_level = parse_level(level)  # InvalidArgument("--log-level") before anything is set up
    configure_logging("WARNING")
    logging.getLogger("dualpace").setLevel(dualpace_level)


def run(args: argparse.Namespace) -> int:
    configure_cli_logging(args.log_level)
    if args.batch < 1:
        raise InvalidArgument("--batch", f"must be >= 1, got {args.batch}")
    if args.threads is not None and args.threads < 1:
        raise InvalidArgument("--threads", f"must be >= 1, got {args.threads}")
    if args.block_size < 1:
        raise InvalidArgument("--block-size", f"must be >= 1, got {args.block_size}")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    ).validate()

    import torch

    from dualpace.generation import OfflineGenerator
    from dualpace.model.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, weights=args.weights)
    use_config_activations(args.quant_activations)
    tokenizer = loaded.tokenizer
    extra_eos: tuple[int, ...] = ()
    if args.prompt_ids is not None:
        if args.chat:
            raise InvalidArgument("--chat", "applies to --prompt text, not to --prompt-ids")
        prompt_ids = parse_prompt_ids(args.prompt_ids)
    elif args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        extra_eos = tokenizer.chat_stop_token_ids
    else:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    prompts = batch_variants(prompt_ids, args.batch, seed=args.seed or 0)
    seeds = [None if args.seed is None else args.seed + i for i in range(len(prompts))]
    generator = OfflineGenerator(loaded, block_size=args.block_size)
    sequences = generator.generate(
        prompts, [SamplingParams(**{**vars(params), "seed": s}) for s in seeds], extra_eos_token_ids=extra_eos
    )
    for seq in sequences:
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({
                "index": seq.seq_id,
                "prompt_token_ids": seq.prompt_token_ids,
                "token_ids": seq.output_token_ids,
                "text": text,
                "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
            }))
        else:
            if len(sequences) > 1:
                print(f"--- sequence {seq.seq_id} ({seq.finish_reason.value}) ---")
            print(text)
    stats = generator.stats
    print(
        f"[{len(sequences)} sequence(s): {stats.num_prompt_tokens} prompt tokens in {stats.prefill_s:.2f} s, "
        f"{stats.num_generated_tokens} generated, decode {stats.decode_tokens_per_s:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0
