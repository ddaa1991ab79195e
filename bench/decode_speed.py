"""Decode tokens/s of the model core at several batch sizes, beside Hugging Face
transformers `generate` on the same model and beside the memory-bandwidth limit,
all measured in one run (these machines are shared and noisy: compare ratios).

    python -m bench.decode_speed --model smollm2-135m --batches 1,8,32 --threads 2 \
        --out bench/results/decode_speed_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from dualpace.generation import OfflineGenerator
from dualpace.model.loader import LoadedModel, load_model
from dualpace.sampling import SamplingParams
from toolkit.memory_bandwidth import copy_bandwidth_bytes_per_s, read_bandwidth_bytes_per_s


def make_prompts(vocab_size: int, batch: int, context_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(context_tokens)] for _ in range(batch)]


def ours_decode_tokens_per_s(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    generator = OfflineGenerator(loaded)
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    best = 0.0
    for _ in range(repeats):
        generator.generate(prompts, params)
        best = max(best, generator.stats.decode_tokens_per_s)
    return best


def hf_decode_tokens_per_s(hf_model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Decode-only rate of transformers generate: (total - prefill) time over new_tokens - 1 steps."""
    input_ids = torch.tensor(prompts)
    attention_mask = torch.ones_like(input_ids)

    def timed(num_new: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            hf_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=num_new,
                              min_new_tokens=num_new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    best = 0.0
    for _ in range(repeats):
        prefill_s = timed(1)
        total_s = timed(new_tokens)
        best = max(best, len(prompts) * (new_tokens - 1) / max(total_s - prefill_s, 1e-9))
    return best


def load_hf_model(loaded: LoadedModel):
    """transformers on the same weights in dense bf16. A GGUF is exported to a Hugging Face
    folder first: loaded from the GGUF directly, transformers may keep the quantized blocks and
    compute through dequantizing kernels, which is not the dense bf16 baseline."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from dualpace.model.export import export_hf_folder

    path = loaded.path
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as folder:
        export_hf_folder(str(path), Path(folder), torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context-tokens", type=int, default=128, help="prompt length of every sequence")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    bandwidth = copy_bandwidth_bytes_per_s()
    read_bandwidth = read_bandwidth_bytes_per_s()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, read {read_bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    loaded = load_model(args.model, dtype="bf16")
    cfg = loaded.config
    weight_bytes = loaded.model.weights.num_bytes()
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    hf_model = None if args.no_hf else load_hf_model(loaded)
    # Warm up oneDNN's bf16 kernels so the first measured batch is not charged for JIT.
    ours_decode_tokens_per_s(loaded, make_prompts(cfg.vocab_size, 2, 16), 4, 1)

    rows = []
    for batch in batches:
        prompts = make_prompts(cfg.vocab_size, batch, args.context_tokens)
        ours = ours_decode_tokens_per_s(loaded, prompts, args.new_tokens, args.repeats)
        hf = None if hf_model is None else hf_decode_tokens_per_s(hf_model, prompts, args.new_tokens, args.repeats)
        mean_context = args.context_tokens + args.new_tokens / 2
        weights_limit = batch * bandwidth / weight_bytes
        weights_kv_limit = batch * bandwidth / (weight_bytes + batch * mean_context * kv_bytes_per_token)
        row = {
            "batch": batch,
            "ours_tokens_per_s": round(ours, 1),
            "hf_tokens_per_s": None if hf is None else round(hf, 1),
            "ours_over_hf": None if hf is None else round(ours / hf, 2),
            "weights_limit_tokens_per_s": round(weights_limit, 1),
            "ours_over_weights_limit": round(ours / weights_limit, 3),
            "weights_kv_limit_tokens_per_s": round(weights_kv_limit, 1),
            "ours_over_weights_kv_limit": round(ours / weights_kv_limit, 3),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    result = {
        "model": args.model,
        "dtype": "bf16",
        "threads": args.threads,
        "context_tokens": args.context_tokens,
        "new_tokens": args.new_tokens,
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
        "read_bandwidth_gb_per_s": round(read_bandwidth / 1e9, 2),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "rows": rows,
    }
    print("| batch | ours tok/s | HF tok/s | ours/HF | weights limit | ours/limit | weights+KV limit | ours/limit |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['ours_tokens_per_s']} | {r['hf_tokens_per_s']} | {r['ours_over_hf']} | "
              f"{r['weights_limit_tokens_per_s']} | {r['ours_over_weights_limit']:.0%} | "
              f"{r['weights_kv_limit_tokens_per_s']} | {r['ours_over_weights_kv_limit']:.0%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
