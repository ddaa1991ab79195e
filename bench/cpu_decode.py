"""CPU decode speed of the model core, beside transformers and the memory-bandwidth limit,
all in one run (these machines are shared and noisy: compare the ratios, not the raw rates).

    python -m bench.cpu_decode --model smollm2-135m --out bench/results/cpu_decode_smollm2.json
    dualpace model synth --preset qwen2.5-0.5b --out /tmp/qwen05b
    python -m bench.cpu_decode --model /tmp/qwen05b --out bench/results/cpu_decode_qwen05b.json
    python -m bench.cpu_decode --weights native --peer llamacpp --no-hf --out bench/results/cpu_decode_q4_1_llamacpp.json

Per (batch, context) row:
- ours: the engine's decode iteration as OfflineGenerator runs it (block-table append, step
  tensors, PagedForward, sampling, bookkeeping), with the context's KV filled with random
  values instead of a prefill (decode speed does not depend on the values; a 32 x 1024-token
  prefill would dominate the run). Reported with the split of an iteration: model forward
  vs everything else (step tensors, sampling, Python bookkeeping = "overhead").
- HF: transformers `generate` (bf16, greedy) on a dense copy of the same weights, with a
  DynamicCache pre-filled with random K/V of the context length, so every generated token is
  a decode step.
- limits: weights limit = batch * copy bandwidth / weight bytes per step (bf16, tied
  embedding counted once; for a mixture-of-experts model the expected bytes of the experts a
  batch selects, MoeWeightBytes.step_bytes); weights+KV limit also counts the KV bytes read at that context.
  Copy bandwidth (read + written bytes of a 512 MiB copy, toolkit/memory_bandwidth.py) is
  re-measured right before each row, and the row's ratios use that measurement. Also the
  fastest single iteration ("fastest step"), which is how the copy bandwidth itself is taken
  (best of a few): on a loaded machine the mean rate also counts the time other tenants held
  the cores. The load average at start and end goes in the JSON.
- attention: decode attention alone over paged bf16 KV (batch 8, 4096 tokens, block 16,
  blocks in shuffled order), cycling through enough layers to exceed the L3 cache; K+V bytes
  read per second against the copy bandwidth (mean call of the best cycle, and the fastest
  single call, which is how the copy bandwidth itself is taken); our kernel beside the torch
  gather path.
- peer (--peer llamacpp, a GGUF model): llama.cpp's llama-batched-bench (bench/llamacpp_peer.py)
  on the same file and thread count, run right after ours at each (batch, context) point:
  its decode tok/s and ours / its. Plus prefill of one --prefill-tokens prompt: ours (one
  PagedForward call, as an engine step of that many prompt tokens) vs its S_PP.
- kernels: the time to build the CPU kernels from scratch (a fresh cache) and to load them
  from the cache, as a new process pays it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.cpu_decode_peer import add_peer_arguments, cpu_model, prefill_row, print_peer_table
from toolkit.cpu_peak import peaks
from toolkit.memory_bandwidth import (
    copy_bandwidth_bytes_per_s,
    read_bandwidth_bytes_per_s,
)
from dualpace.kv.block_table import KVBlockManager
from dualpace.kv.storage import KVStorage
from dualpace.model import cpu_kernels
from dualpace.model.attention import decode_attention
from dualpace.model.loader import LoadedModel, load_model, moe_weight_bytes, weights_num_bytes
from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors
from dualpace.model.quant_activations import add_quant_activations_argument, use_config_activations
from dualpace.sampling import SamplingParams, sample_next_tokens

BLOCK_SIZE = 16


def bandwidth() -> float:
    return copy_bandwidth_bytes_per_s(repeats=6)


def ours_decode(loaded: LoadedModel, batch: int, context: int, new_tokens: int, repeats: int) -> dict:
    """Best-of-`repeats` decode rate of the engine's iteration over a random-filled KV cache."""
    cfg = loaded.config
    model = loaded.model
    blocks = KVBlockManager(batch * -(-(context + new_tokens + 2) // BLOCK_SIZE), BLOCK_SIZE)
    kv = KVStorage(cfg.num_layers, blocks.num_total_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                   model.dtype, model.device)
    kv.k.normal_()
    kv.v.normal_()
    forward = PagedForward(model, kv)
    rng = random.Random(batch * 7919 + context)
    params = [SamplingParams(max_tokens=new_tokens + 2, ignore_eos=True)] * batch
    seeds = list(range(batch))
    best: dict | None = None
    step_times_s: list[float] = []  # every timed iteration of every repeat
    for _ in range(repeats):
        for seq_id in range(batch):
            blocks.allocate(seq_id, context)
        last_tokens = [rng.randrange(cfg.vocab_size) for _ in range(batch)]
        num_tokens = [context] * batch
        prep_s = forward_s = rest_s = 0.0
        steps = 0
        for step_index in range(new_tokens + 2):
            t0 = time.perf_counter()
            work = []
            for seq_id in range(batch):
                blocks.append(seq_id, 1)
                work.append(SequenceWork([last_tokens[seq_id]], num_tokens[seq_id], blocks.block_ids(seq_id)))
            step = build_step_tensors(work, BLOCK_SIZE, model.device)
            t1 = time.perf_counter()
            logits = forward.forward_tensors(step)
            t2 = time.perf_counter()
            result = sample_next_tokens(logits, params, seeds, [n + 1 for n in num_tokens])
            for seq_id, token_id in enumerate(result.token_ids):
                last_tokens[seq_id] = token_id
                num_tokens[seq_id] += 1
            t3 = time.perf_counter()
            if step_index >= 2:  # the first steps warm caches and allocators
                prep_s += t1 - t0
                forward_s += t2 - t1
                rest_s += t3 - t2
                steps += 1
                step_times_s.append(t3 - t0)
        for seq_id in range(batch):
            blocks.free(seq_id)
        total_s = prep_s + forward_s + rest_s
        run = {
            "tokens_per_s": batch * steps / total_s,
            "iteration_ms": 1e3 * total_s / steps,
            "forward_ms": 1e3 * forward_s / steps,
            "overhead_ms": 1e3 * (prep_s + rest_s) / steps,
            "overhead_fraction": (prep_s + rest_s) / total_s,
            "step_tensors_ms": 1e3 * prep_s / steps,
            "sampling_and_bookkeeping_ms": 1e3 * rest_s / steps,
        }
        if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
            best = run
    assert best is not None
    step_times_s.sort()
    best["median_step_ms"] = 1e3 * step_times_s[len(step_times_s) // 2]
    best["fastest_step_ms"] = 1e3 * step_times_s[0]
    return best


def load_hf(loaded: LoadedModel):
    from toolkit.hf_reference import load_hf_model

    return load_hf_model(loaded)


def hf_decode(hf_model, batch: int, context: int, new_tokens: int, repeats: int) -> float:
    """transformers generate, decode steps only: the cache already holds `context` random tokens."""
    from transformers import DynamicCache

    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (batch, cfg.num_key_value_heads, context, head_dim)
    input_ids = torch.randint(100, cfg.vocab_size, (batch, context + 1))
    attention_mask = torch.ones_like(input_ids)
    best = 0.0
    for _ in range(repeats):
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            cache.update(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16), layer)
        start = time.perf_counter()
        with torch.no_grad():
            hf_model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        best = max(best, batch * new_tokens / (time.perf_counter() - start))
    return best


def attention_bench(num_kv_heads: int, group: int, head_dim: int, batch: int, context: int, repeats: int,
                    cache_bytes_min: int = 512 * 2**20) -> dict:
    """Decode attention alone: K+V bytes read per second, our kernel vs the torch gather path."""
    bytes_per_layer = 2 * batch * context * num_kv_heads * head_dim * 2
    num_layers = max(2, -(-cache_bytes_min // bytes_per_layer))
    num_blocks = batch * context // BLOCK_SIZE
    kv = KVStorage(num_layers, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, torch.bfloat16)
    kv.k.normal_()
    kv.v.normal_()
    tables = torch.randperm(num_blocks).view(batch, context // BLOCK_SIZE)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, num_kv_heads * group, head_dim).bfloat16()
    scale = head_dim**-0.5

    def timed() -> tuple[float, float]:
        """(mean, fastest) seconds per call over one cycle through the layers."""
        fastest = float("inf")
        start = time.perf_counter()
        for layer in range(num_layers):
            call_start = time.perf_counter()
            decode_attention(q, kv.k[layer], kv.v[layer], tables, lens, scale)
            fastest = min(fastest, time.perf_counter() - call_start)
        return (time.perf_counter() - start) / num_layers, fastest

    # Rounds of (ours, torch, copy) so that a burst of load from another tenant hits all three.
    # Two figures: the mean call of the best cycle through the layers, and the fastest single call
    # (every call reads its layer from DRAM). The copy bandwidth is itself the fastest of a few
    # copies, so the fastest call is the like-for-like ratio; on a loaded machine the mean also
    # counts the time the other tenants took the cores.
    ours_s = ours_call_s = torch_s = float("inf")
    copy_bw = 0.0
    enabled = cpu_kernels.get() is not None
    with torch.inference_mode():
        timed()
        for _ in range(repeats):
            mean_s, call_s = timed()
            ours_s, ours_call_s = min(ours_s, mean_s), min(ours_call_s, call_s)
            cpu_kernels.set_enabled(False)
            try:
                torch_s = min(torch_s, timed()[0])
            finally:
                cpu_kernels.set_enabled(True)
            copy_bw = max(copy_bw, bandwidth())
    return {
        "batch": batch, "context_tokens": context, "num_kv_heads": num_kv_heads, "group": group,
        "head_dim": head_dim, "layers_cycled": num_layers, "kv_bytes_per_call": bytes_per_layer,
        "kernels": enabled,
        "ours_ms": round(1e3 * ours_s, 3),
        "ours_gb_per_s": round(bytes_per_layer / ours_s / 1e9, 1),
        "torch_gather_ms": round(1e3 * torch_s, 3),
        "torch_gather_gb_per_s": round(bytes_per_layer / torch_s / 1e9, 1),
        "copy_bandwidth_gb_per_s": round(copy_bw / 1e9, 1),
        "ours_over_copy_bandwidth": round(bytes_per_layer / ours_s / copy_bw, 3),
        "ours_fastest_call_ms": round(1e3 * ours_call_s, 3),
        "ours_fastest_call_gb_per_s": round(bytes_per_layer / ours_call_s / 1e9, 1),
        "ours_fastest_call_over_copy_bandwidth": round(bytes_per_layer / ours_call_s / copy_bw, 3),
    }


def kernel_build_times() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        seconds = cpu_kernels.build(Path(folder) / "k.so")
    path = cpu_kernels.library_path()
    cached = path.exists()
    if not cached:
        cpu_kernels.get()  # first use of this source or variant: builds it into the cache
    if not path.exists():
        return {"build_s": round(seconds, 2), "cached_load_s": None, "cache_existed": False}
    import ctypes

    start = time.perf_counter()
    ctypes.CDLL(str(path))
    return {"build_s": round(seconds, 2), "cached_load_s": round(time.perf_counter() - start, 3),
            "cache_existed": cached}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per repeat (ours)")
    parser.add_argument("--hf-new-tokens", type=int, default=16, help="decode steps timed per repeat (HF)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-kernels", action="store_true", help="run our engine on plain torch ops")
    parser.add_argument("--attention-context", type=int, default=4096)
    parser.add_argument("--attention-batch", type=int, default=8)
    parser.add_argument("--attention-only", action="store_true",
                        help="only the attention measurement (no decode rows, no transformers)")
    parser.add_argument("--weights", default="bf16", choices=["native", "bf16", "fp32", "int8"],
                        help="as `dualpace generate --weights` (native: a GGUF's blocks as they are)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="compute dtype")
    add_peer_arguments(parser)
    add_quant_activations_argument(parser)
    parser.add_argument("--no-build-times", action="store_true",
                        help="skip timing a fresh build of the CPU kernels (a minute of compiling)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    load_at_start = list(os.getloadavg())  # other tenants of a shared machine (1, 5, 15 min)
    torch.set_num_threads(args.threads)
    if args.no_kernels:
        cpu_kernels.set_enabled(False)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]

    kernels = None if args.no_kernels or args.no_build_times else kernel_build_times()
    loaded = load_model(args.model, dtype=args.dtype, weights=args.weights)
    use_config_activations(args.quant_activations)
    cfg = loaded.config
    weight_bytes = weights_num_bytes(loaded.model.weights)
    moe = moe_weight_bytes(loaded.model.weights, cfg)  # a MoE step reads the experts its rows select

    def step_weight_bytes(batch: int) -> float:
        return weight_bytes if moe is None else moe.step_bytes(batch)
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * loaded.model.dtype.itemsize
    peer = None
    if args.peer == "llamacpp":
        from bench import llamacpp_peer as peer

        if loaded.path.suffix != ".gguf":
            parser.error("--peer llamacpp needs a GGUF model")
        peer.build()
    if args.attention_only:
        batches, contexts = [], []
    hf_model = None if args.no_hf or args.attention_only else load_hf(loaded)
    print(f"{args.model}: {weight_bytes / 1e6:.0f} MB of {args.weights} weights, kernels "
          f"{'off' if cpu_kernels.get() is None else 'on'}", file=sys.stderr)
    if batches and contexts:
        ours_decode(loaded, 2, 64, 4, 1)  # warm up allocator and kernels

    rows = []
    for context in contexts:
        for batch in batches:
            copy_bw = bandwidth()
            ours = ours_decode(loaded, batch, context, args.new_tokens, args.repeats)
            hf = None
            if hf_model is not None:
                hf = hf_decode(hf_model, batch, context, args.hf_new_tokens, max(1, args.repeats - 1))
            peer_tps = None if peer is None else max(  # best of repeats, as ours
                peer.decode_tokens_per_s(loaded.path, args.threads, batch, context, args.new_tokens)
                for _ in range(args.repeats))
            copy_bw = max(copy_bw, bandwidth())  # best of before and after: the limit is not understated
            mean_context = context + args.new_tokens / 2
            weights_limit = batch * copy_bw / step_weight_bytes(batch)
            weights_kv_limit = batch * copy_bw / (step_weight_bytes(batch) + batch * mean_context * kv_bytes_per_token)
            row = {
                "batch": batch,
                "context_tokens": context,
                "ours_tokens_per_s": round(ours["tokens_per_s"], 1),
                "hf_tokens_per_s": None if hf is None else round(hf, 1),
                "ours_over_hf": None if hf is None else round(ours["tokens_per_s"] / hf, 2),
                "llamacpp_tokens_per_s": None if peer_tps is None else round(peer_tps, 1),
                "ours_over_llamacpp": None if peer_tps is None else round(ours["tokens_per_s"] / peer_tps, 2),
                "copy_bandwidth_gb_per_s": round(copy_bw / 1e9, 1),
                "weights_limit_tokens_per_s": round(weights_limit, 1),
                "ours_over_weights_limit": round(ours["tokens_per_s"] / weights_limit, 3),
                "weights_kv_limit_tokens_per_s": round(weights_kv_limit, 1),
                "ours_over_weights_kv_limit": round(ours["tokens_per_s"] / weights_kv_limit, 3),
                # the fastest single iteration, like the copy bandwidth (best of a few copies):
                # on a loaded machine the mean also counts the time other tenants took the cores
                "ours_fastest_step_tokens_per_s": round(1e3 * batch / ours["fastest_step_ms"], 1),
                # the median iteration of every timed step (all repeats): the figure held against 80%
                "ours_median_step_over_weights_limit": round(1e3 * batch / ours["median_step_ms"] / weights_limit, 3),
                "ours_fastest_step_over_weights_kv_limit": round(
                    1e3 * batch / ours["fastest_step_ms"] / weights_kv_limit, 3),
                **{k: round(v, 3) for k, v in ours.items() if k != "tokens_per_s"},
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)

    prefill = None
    if peer is not None and args.prefill_tokens:
        prefill = prefill_row(loaded, peer, args.threads, args.prefill_tokens, args.repeats)
        print(json.dumps(prefill), file=sys.stderr)
    attention = attention_bench(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim,
                                args.attention_batch, args.attention_context, args.repeats)
    print(json.dumps(attention), file=sys.stderr)

    result = {
        "model": os.path.basename(args.model),  # a file or folder by its name: no machine paths in results
        "weights": args.weights,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "quant_activations": args.quant_activations,
        "cpu_peak_macs_per_s": peaks([args.threads]),
        "peer": args.peer,
        "peer_flags": peer.peer_flags() if args.peer == "llamacpp" else [],
        "prefill": prefill,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "hf_new_tokens": args.hf_new_tokens,
        "read_bandwidth_gb_per_s": round(read_bandwidth_bytes_per_s() / 1e9, 1),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "kernels": kernels,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_kernels": cpu_kernels.kernel_info(),
        "load_average_at_start": load_at_start,
        "load_average_at_end": list(os.getloadavg()),
        "rows": rows,
        "attention": attention,
    }
    if peer is not None:
        print_peer_table(rows, prefill)
    print("| batch | context | ours tok/s | HF tok/s | ours/HF | copy GB/s | weights limit | ours/limit "
          "| weights+KV limit | ours/limit | fastest step tok/s | fastest/limit | median step/limit | iteration ms | overhead |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context_tokens']} | {r['ours_tokens_per_s']} | {r['hf_tokens_per_s']} | "
              f"{r['ours_over_hf']} | {r['copy_bandwidth_gb_per_s']} | {r['weights_limit_tokens_per_s']} | "
              f"{r['ours_over_weights_limit']:.0%} | {r['weights_kv_limit_tokens_per_s']} | "
              f"{r['ours_over_weights_kv_limit']:.0%} | {r['ours_fastest_step_tokens_per_s']} | "
              f"{r['ours_fastest_step_over_weights_kv_limit']:.0%} | {r['ours_median_step_over_weights_limit']:.0%} | "
              f"{r['iteration_ms']:.2f} | "
              f"{r['overhead_fraction']:.1%} |")
    a = attention
    print(f"\nattention (batch {a['batch']}, {a['context_tokens']} tokens): ours {a['ours_gb_per_s']} GB/s "
          f"({a['ours_over_copy_bandwidth']:.0%} of copy {a['copy_bandwidth_gb_per_s']} GB/s; fastest call "
          f"{a['ours_fastest_call_gb_per_s']} GB/s = {a['ours_fastest_call_over_copy_bandwidth']:.0%}), "
          f"torch gather {a['torch_gather_gb_per_s']} GB/s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
