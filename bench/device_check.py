"""GPU check, run on a machine with CUDA (the `device` tool), in well under 5 minutes:

0. the CUDA-only tests (tests/model/test_cuda_fast_paths.py: CUDA-graph decode equals eager token
   for token, the fused kernels' bf16 rounding, pinned KV copies), in a pytest subprocess;
1. gpu_service on cuda, tiny fp32 model, in each configuration of CONFIGS (the paged Triton
   attention with fused norm/RoPE and CUDA graphs, the same without graphs, without the fused
   kernels, and the gather path with none of them): greedy streams equal the CPU device's
   `OfflineGenerator` token for token (clear top-1 margins, so this is exact);
2. a synthetic ~1B checkpoint (llama-3.2-1b shape): fp32 prompt logits on cuda vs
   the CPU device (max |diff|) and greedy agreement (random weights give near-ties,
   so agreement is reported, not required);
3. device -> host copy bandwidth of a KV-sized buffer, pageable and pinned, and through the KV
   export's own path (dualpace.model.host_copies: gather, pinned, side stream);
4. throughput: gpu_service on cuda, bf16 ~1B model, at 1, 32 and 128 concurrent streams,
   in each configuration (so with and without CUDA graphs, and with and without the fused kernels).

On the GPU machine (it reaches no registry) the wheels it lacks travel with the check:
`make device-check` prepares them and prints the command (toolkit/device_wheels.py).

    python -m bench.device_check --out bench/results/device_check.json

`--device cpu --large-preset tiny-llama --streams 2` runs the same script here as a dry run
(the configurations then all run the torch ops: Triton and CUDA graphs run on CUDA only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dualpace.generation import OfflineGenerator
from dualpace.kv.storage import KVStorage
from dualpace.model.host_copies import HostCopies
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


# name -> gpu_service arguments; "auto" means the Triton kernels on CUDA
# (dualpace.model.attention_backend), the torch ops elsewhere.
CONFIGS = {
    "paged_fused_graphs": ["--attention-backend", "auto", "--fused-kernels", "auto", "--cuda-graphs", "on"],
    "paged_fused_eager": ["--attention-backend", "auto", "--fused-kernels", "auto", "--cuda-graphs", "off"],
    "paged_torchnorm_graphs": ["--attention-backend", "auto", "--fused-kernels", "torch", "--cuda-graphs", "on"],
    "gather_torch_eager": ["--attention-backend", "gather", "--fused-kernels", "torch", "--cuda-graphs", "off"],
}


def cuda_tests() -> dict:
    """The tests that need CUDA, in their own process (no TRITON_INTERPRET there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/model/test_cuda_fast_paths.py"], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {"returncode": done.returncode, "summary": lines[-1] if lines else "", "tail": lines[-15:]}


def tiny_parity(folder: str, device: str, config: str) -> dict:
    daemon = start_daemon("gpu_service", "--model", folder, "--dtype", "fp32", "--device", device, *CONFIGS[config])
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
    # the KV export's path: rows gathered, copied into pinned memory on a side stream (plain on a CPU)
    flat_cache = source.view(-1, 4096)
    all_rows = torch.arange(flat_cache.shape[0], device="cpu")
    copies = HostCopies(torch.device(device))
    copies.gather_to_host([flat_cache], all_rows)  # warm-up
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copies.gather_to_host([flat_cache], all_rows)
        best_s = min(best_s, time.perf_counter() - start)
    report["kv_export_path_gbps"] = round(num_bytes / best_s / 1e9, 2)
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


def throughput_sweep(folder: str, device: str, config: str, stream_counts: list[int], prompt_tokens: int,
                     new_tokens: int) -> dict:
    """One daemon per configuration, the stream counts run one after another on it."""
    daemon = start_daemon("gpu_service", "--model", folder, "--dtype", "bf16", "--device", device,
                          "--kv-blocks", "4096", "--max-batch-tokens", "8192", "--max-running",
                          str(max(stream_counts)), *CONFIGS[config])
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
        steps = [("cuda_tests", cuda_tests)] if args.device.startswith("cuda") else []
        steps += [(f"tiny_parity_{c}", lambda c=c: tiny_parity(str(tiny), args.device, c)) for c in CONFIGS]
        steps.append(("large_fp32_logits", lambda: large_logits(str(large), args.device)))
        steps.append(("kv_copy_device_to_host", lambda: kv_copy_bandwidth(args.device)))
        steps += [(f"throughput_bf16_{c}", lambda c=c: throughput_sweep(
            str(large), args.device, c, stream_counts, args.prompt_tokens, args.new_tokens)) for c in CONFIGS]
        for name, step in steps:
            start = time.perf_counter()
            report[name] = step()
            report[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(name, json.dumps(report[name]), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    table = summary_table(report, stream_counts)
    print(table, file=sys.stderr)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(table + "\n")
    parity = all(report[f"tiny_parity_{c}"]["all_identical"] for c in CONFIGS)
    return 0 if parity and report.get("cuda_tests", {"returncode": 0})["returncode"] == 0 else 1


def summary_table(report: dict, stream_counts: list[int]) -> str:
    """Decode throughput (tokens/s) per configuration and stream count, as a Markdown table."""
    lines = ["| configuration | tiny parity | " + " | ".join(f"{n} streams tok/s" for n in stream_counts) + " |",
             "|---|---|" + "---|" * len(stream_counts)]
    for config in CONFIGS:
        sweep = report[f"throughput_bf16_{config}"]
        cells = [str(sweep[f"streams_{n}"]["tokens_per_s"]) for n in stream_counts]
        parity = report[f"tiny_parity_{config}"]
        lines.append(f"| {config} | {parity['identical']}/{parity['prompts']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
