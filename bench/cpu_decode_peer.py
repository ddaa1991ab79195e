"""The llama.cpp side of bench/cpu_decode.py: its arguments, the prefill comparison, the peer table, the CPU name."""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

from dualpace.kv.storage import KVStorage
from dualpace.model.loader import LoadedModel
from dualpace.model.paged_forward import PagedForward, SequenceWork

BLOCK_SIZE = 16


def ours_prefill(loaded: LoadedModel, prompt_tokens: int, repeats: int) -> float:
    """Best-of-`repeats` prompt tokens/s of one prefill step of `prompt_tokens` random tokens."""
    cfg = loaded.config
    num_blocks = -(-prompt_tokens // BLOCK_SIZE)
    kv = KVStorage(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, loaded.model.dtype,
                   loaded.model.device)
    forward = PagedForward(loaded.model, kv)
    rng = random.Random(prompt_tokens)
    token_ids = [rng.randrange(cfg.vocab_size) for _ in range(prompt_tokens)]
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        forward.forward([SequenceWork(token_ids, 0, list(range(num_blocks)))])
        best = max(best, prompt_tokens / (time.perf_counter() - start))
    return best


def prefill_row(loaded: LoadedModel, peer, threads: int, prompt_tokens: int, repeats: int) -> dict:
    """Ours vs the peer's S_PP on one prompt of `prompt_tokens` tokens, run back to back."""
    ours = ours_prefill(loaded, prompt_tokens, repeats)
    theirs = max(peer.prefill_tokens_per_s(loaded.path, threads, prompt_tokens) for _ in range(repeats))
    return {"prompt_tokens": prompt_tokens, "ours_tokens_per_s": round(ours, 1),
            "llamacpp_tokens_per_s": round(theirs, 1), "ours_over_llamacpp": round(ours / theirs, 2)}


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer", choices=["llamacpp"], help="run llama.cpp beside ours on the same GGUF")
    parser.add_argument("--prefill-tokens", type=_prompt_tokens, default=512,
                        help="prompt of the prefill comparison (0: none, e.g. beside a context-1024 grid)")


def _prompt_tokens(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 (no prefill comparison) or more")
    return value


def print_peer_table(rows: list[dict], prefill: dict | None) -> None:
    print("| batch | context | ours tok/s | llama.cpp tok/s | ours/llama.cpp | copy GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context_tokens']} | {r['ours_tokens_per_s']} | {r['llamacpp_tokens_per_s']} | "
              f"{r['ours_over_llamacpp']} | {r['copy_bandwidth_gb_per_s']} |")
    if prefill is not None:  # None: --prefill-tokens 0
        print(f"prefill {prefill['prompt_tokens']} tokens: ours {prefill['ours_tokens_per_s']} tok/s, llama.cpp "
              f"{prefill['llamacpp_tokens_per_s']} ({prefill['ours_over_llamacpp']}x)")
    print()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
