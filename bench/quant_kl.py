"""How close the block-quantized path's next-token distributions stay to the same file dequantized to
fp32, per activation mode (--quant-activations exact / int8), beside llama.cpp's on the same file.

    python -m bench.quant_kl --model smollm2-135m --text README.md --out bench/results/quant_kl_q4_1_xeon_amx.json
    python -m bench.quant_kl --model F.gguf --text README.md --peer llamacpp

The text is cut into windows of --window tokens (a fresh context each, as llama-perplexity's
chunks); each window runs through PagedForward in prompt chunks of --chunk tokens (with the int8
mode's kernels from 5 rows: the rows of a batched decode step or a prompt chunk), and the second
half of every window is scored: mean KL(P_ref || P_mode) over those positions, P_ref from the
same file's weights dequantized to fp32 at load (weights="fp32") in one pass per window. Also
the share of positions whose top token differs from the reference's.

--peer llamacpp: llama.cpp's `llama-perplexity --kl-divergence` on the same text (its own
tokenization), same window (-c), the reference being the file re-encoded as F32
(`dualpace model export --gguf f32`, the same dequantized values), scoring as it does (the
second half of each chunk): its mean KLD and top-token mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from dualpace.kv.storage import KVStorage
from dualpace.model import quant_kernels
from dualpace.model.loader import LoadedModel, load_model
from dualpace.model.paged_forward import PagedForward, SequenceWork

BLOCK_SIZE = 16


def window_log_probs(loaded: LoadedModel, token_ids: list[int], chunk: int) -> torch.Tensor:
    """log-softmax of the logits at every position of one window, fed in prompt chunks of `chunk`."""
    cfg = loaded.config
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    kv = KVStorage(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, loaded.model.dtype,
                   loaded.model.device)
    forward = PagedForward(loaded.model, kv)
    blocks = list(range(num_blocks))
    parts = []
    for start in range(0, len(token_ids), chunk):
        ids = token_ids[start:start + chunk]
        parts.append(forward.forward([SequenceWork(ids, start, blocks, all_logits=True)]))
    return torch.log_softmax(torch.cat(parts).double(), -1)


def compare(ref: torch.Tensor, ours: torch.Tensor) -> tuple[float, int]:
    """Sum over positions of KL(ref || ours), and the number of positions whose top token differs."""
    kl = (ref.exp() * (ref - ours)).sum(-1)
    return kl.sum().item(), int((ref.argmax(-1) != ours.argmax(-1)).sum().item())


def ours_kl(model: str, tokens: list[int] | None, text: str, window: int, chunk: int, modes: list[str],
            num_tokens: int) -> dict:
    ref_model = load_model(model, dtype="fp32", weights="fp32")
    native = load_model(model, dtype="fp32", weights="native")
    ids = tokens or native.tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:num_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    if not windows:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than one window of {window}")
    sums = {mode: [0.0, 0, 0] for mode in modes}
    for w in windows:
        ref = window_log_probs(ref_model, w, window)[window // 2:]
        for mode in modes:
            quant_kernels.use_config_activations(mode)
            kl, flips = compare(ref, window_log_probs(native, w, chunk)[window // 2:])
            sums[mode][0] += kl
            sums[mode][1] += flips
            sums[mode][2] += ref.shape[0]
    quant_kernels.use_config_activations("exact")
    return {mode: {"mean_kl": s[0] / s[2], "top_token_differs": s[1] / s[2], "positions": s[2]}
            for mode, s in sums.items()} | {"tokens": len(windows) * window}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="known name or .gguf file")
    parser.add_argument("--text", required=True, help="a text file (at least --tokens tokens)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text used (whole windows)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=32, help="prompt chunk of our forward (rows per kernel call)")
    parser.add_argument("--modes", default="exact,int8", help="--quant-activations values to score")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", choices=["llamacpp"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = Path(args.text).read_text()
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in quant_kernels.CONFIG_ACTIVATIONS:
            raise SystemExit(f"--modes: unknown {mode!r}")
    result = {"model": os.path.basename(args.model), "text": os.path.basename(args.text),
              "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "window": args.window, "chunk": args.chunk,
              "threads": args.threads, "ours": ours_kl(args.model, None, text, args.window, args.chunk, modes,
                                                       args.tokens)}
    if args.peer == "llamacpp":
        from bench import llamacpp_peer
        from dualpace.model.gguf_requant import requantize_gguf
        from dualpace.model.registry import resolve_model_path

        with tempfile.TemporaryDirectory() as folder:
            base = requantize_gguf(args.model, Path(folder) / "f32.gguf", "f32")
            result["llamacpp"] = llamacpp_peer.kl_divergence(base, resolve_model_path(args.model), Path(args.text),
                                                             args.window, args.threads, Path(folder))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
