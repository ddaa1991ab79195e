"""GPU check, run on a machine with CUDA (the `device` tool), in well under 5 minutes:

1. gpu_service on cuda, tiny fp32 model, with each attention backend (the paged Triton kernel,
   `auto` on CUDA, and the gather path): greedy streams equal the CPU device's
   `OfflineGenerator` token for token (clear top-1 margins, so this is exact);
2. a synthetic ~1B checkpoint (llama-3.2-1b shape): fp32 prompt logits on cuda vs
   the CPU device (max |diff|) and greedy agreement (random weights give near-ties,
   so agreement is reported, not required);
3. device -> host copy bandwidth of a KV-sized buffer, pageable and pinned;
4. throughput: gpu_service on cuda, bf16 ~1B model, at 1, 32 and 128 concurrent streams,
   with each attention backend.

On the GPU machine (it reaches no registry) the wheels it lacks travel with the check:
`make device-check` prepares them and prints the command (bench/device_wheels.py).

    python -m bench.device_check --out bench/results/device_check.json

`--device cpu --large-preset tiny-llama --streams 2` runs the same script here as a dry run
(the backends are then both the gather path: Triton runs on CUDA only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dualpace.generation import OfflineGenerator
from dualpace.kv.storage import KVStorage
from dualpace.model.loader import load_model
from dualpace.model.paged_forward import PagedForward, SequenceWork
from dualpace.model.synth import write_synthetic_checkpoint
from dualpace.sampling import SamplingParams
from toolkit.engine_client import EngineClient
from toolkit.processes import start_daemon

PROMPTS = [[5, 9, 2, 11, 40], [1] * 17, [300, 200, 100, 7, 7, 7, 3], list(range(10, 60))]


def stream_tokens(address: str, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    client = EngineClient(address)
    try:
        start = time.perf_counter()
        ttft_s, tokens = None, []
        for response in client.stream(request_id, prompt, params, timeout_s=300):
            if ttft_s is None and response.token_ids:
                ttft_s = time.perf_counter() - start
            tokens.extend(response.token_ids)
    finally:
        client.close()
    return tokens, ttft_s or 0.0


BACKENDS = ("auto", "gather")  # auto: the paged Triton kernel on CUDA (dualpace.model.attention_backend)


def backend_env(backend: str) -> dict[str, str]:
    return {"DUALPACE_ATTENTION_BACKEND": backend}


def tiny_parity(folder: str, device: str, backend: str) -> dict:
    daemon = start_daemon("gpu_service", "--model", folder, "--dtype", "fp32", "--device", device,
                          env=backend_env(backend))
    try:
        reference = load_model(folder, dtype="fp32", device="cpu")
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        matches = []
        for i, prompt in enumerate(PROMPTS):
            tokens, _ = stream_tokens(daemon.address, f"p{i}", prompt, params)
            matches.append(tokens == OfflineGenerator(reference).generate([prompt], [params])[0].output_token_ids)
    finally:
        daemon.stop()
    return {"prompts": len(PROMPTS), "identical": sum(matches), "all_identical": all(matches)}


def prompt_logits(folder: str, device: str, prompt: list[int]) -> torch.Tensor:
    loaded = load_model(folder, dtype="fp32", device=device)
    cfg = loaded.config
    kv = KVStorage(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, loaded.model.device)
    logits = PagedForward(loaded.model, kv).forward([SequenceWork(prompt, 0, list(range(8)), all_logits=True)])
    return logits.cpu()


def large_logits(folder: str, device: str) -> dict:
    prompt = PROMPTS[3]
    on_device, on_cpu = prompt_logits(folder, device, prompt), prompt_logits(folder, "cpu", prompt)
    return {
        "max_abs_logit_diff": (on_device - on_cpu).abs().max().item(),
        "argmax_agreement": (on_device.argmax(-1) == on_cpu.argmax(-1)).float().mean().item(),
    }


def kv_copy_bandwidth(device: str, num_bytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Device -> host copy GB/s of a KV-sized buffer, into pageable and (on CUDA) pinned memory:
    what a KV export or a Dense Assist payload moves at best."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    targets = {"pageable": torch.empty(num_bytes, dtype=torch.uint8)}
    if device.startswith("cuda"):
        targets["pinned"] = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    report = {"bytes": num_bytes}
    for name, target in targets.items():
        target.copy_(source)  # warm-up
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(source, non_blocking=name == "pinned")
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best_s = min(best_s, time.perf_counter() - start)
        report[f"{name}_gbps"] = round(num_bytes / best_s / 1e9, 2)
    return report


def throughput_sweep(folder: str, device: str, backend: str, stream_counts: list[int], prompt_tokens: int,
                     new_tokens: int) -> dict:
    """One daemon per backend, the stream counts run one after another on it."""
    daemon = start_daemon("gpu_service", "--model", folder, "--dtype", "bf16", "--device", device,
                          "--kv-blocks", "4096", "--max-batch-tokens", "8192", "--max-running",
                          str(max(stream_counts)), env=backend_env(backend))
    try:
        stream_tokens(daemon.address, "warmup", list(range(10, 26)), SamplingParams(max_tokens=4, ignore_eos=True))
        return {f"streams_{n}": throughput(daemon.address, n, prompt_tokens, new_tokens) for n in stream_counts}
    finally:
        daemon.stop()


def throughput(address: str, num_streams: int, prompt_tokens: int, new_tokens: int) -> dict:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    results: dict[int, tuple[list[int], float]] = {}
    prompts = [[(i * 7 + j) % 1000 + 10 for j in range(prompt_tokens)] for i in range(num_streams)]

    def run(i: int) -> None:
        results[i] = stream_tokens(address, f"t{num_streams}-{i}", prompts[i], params)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    elapsed_s = time.perf_counter() - start
    num_tokens = sum(len(tokens) for tokens, _ in results.values())
    ttfts = sorted(ttft for _, ttft in results.values())
    return {
        "streams": num_streams, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "completed": len(results), "generated_tokens": num_tokens, "elapsed_s": round(elapsed_s, 2),
        "tokens_per_s": round(num_tokens / elapsed_s, 1), "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--large-preset", default="llama-3.2-1b")
    parser.add_argument("--streams", default="1,32,128", help="comma-separated concurrent stream counts")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("device_check: CUDA is not available on this machine", file=sys.stderr)
        return 2
    report: dict = {"device": args.device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    with tempfile.TemporaryDirectory() as workdir:
        tiny = Path(workdir) / "tiny"
        write_synthetic_checkpoint("tiny-llama", tiny, seed=0)
        large = Path(workdir) / "large"
        write_synthetic_checkpoint(args.large_preset, large, seed=0)
        stream_counts = [int(n) for n in args.streams.split(",")]
        steps = [(f"tiny_parity_{b}", lambda b=b: tiny_parity(str(tiny), args.device, b)) for b in BACKENDS]
        steps.append(("large_fp32_logits", lambda: large_logits(str(large), args.device)))
        steps.append(("kv_copy_device_to_host", lambda: kv_copy_bandwidth(args.device)))
        steps += [(f"throughput_bf16_{b}", lambda b=b: throughput_sweep(
            str(large), args.device, b, stream_counts, args.prompt_tokens, args.new_tokens)) for b in BACKENDS]
        for name, step in steps:
            start = time.perf_counter()
            report[name] = step()
            report[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(name, json.dumps(report[name]), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(report[f"tiny_parity_{b}"]["all_identical"] for b in BACKENDS) else 1


if __name__ == "__main__":
    sys.exit(main())
