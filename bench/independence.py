"""Independence of the CPU engine: CPU-resident ITL while the GPU engine serves long prefills.

Both engines run on this machine's CPU, pinned to different cores (gpu_service on
core 0 standing in for the GPU, cpu_service on core 1). A set of requests is
prefilled on gpu_service and handed to cpu_service (KV migration); while they
decode there, a client keeps gpu_service busy with long prefills. The inter-token
gaps of the CPU-resident streams are measured at the client, for:

- dualpace: cpu_service runs its own loop, Local or Assisted per iteration (auto);
- gated: the NEO-like baseline, the same code with every CPU iteration assisted and
  started only at a GPU iteration boundary.

    python -m bench.independence --out bench/results/independence_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from dualpace.sampling import SamplingParams
from dualpace.stats import percentile
from toolkit.engine_client import EngineClient, read_until
from toolkit.processes import start_daemon


def hand_off(gpu: EngineClient, cpu: EngineClient, request_id: str, prompt: list[int], params: SamplingParams):
    tokens: list[int] = []
    responses = gpu.stream(request_id, prompt, params)
    read_until(responses, tokens, stop_after_tokens=1)
    gpu.migrate(request_id, cpu.address)
    read_until(responses, tokens)
    return tokens, cpu.resume(request_id, len(tokens))


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    common = ("--model", args.model, "--threads", "1", "--dtype", args.dtype)
    # The load is one prompt prefilled again and again: with a prefix cache it would cost nothing.
    gpu_daemon = start_daemon("gpu_service", *common, "--kv-blocks", "512", "--max-batch-tokens",
                              str(args.prefill_tokens), "--prefix-caching", "off", cpu_cores="0")
    cpu_flags = ["--policy", policy, "--gpu-service", gpu_daemon.address, "--assist-timeout-s", "120"]
    cpu_daemon = start_daemon("cpu_service", *common, *cpu_flags, cpu_cores="1")
    gpu, cpu = EngineClient(gpu_daemon.address), EngineClient(cpu_daemon.address)
    stop_prefills = threading.Event()
    prefill_s: list[float] = []

    def keep_gpu_busy() -> None:
        prompt = [(7 * i) % 5000 + 100 for i in range(args.prefill_tokens)]
        while not stop_prefills.is_set() and len(prefill_s) < args.max_prefills:
            tokens: list[int] = []
            start = time.perf_counter()
            read_until(gpu.stream(f"prefill-{len(prefill_s)}", prompt, SamplingParams(max_tokens=1)), tokens)
            prefill_s.append(time.perf_counter() - start)

    try:
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        streams = [hand_off(gpu, cpu, f"{policy}-{i}", [11 + i, 22, 33, 44] * 8, params)
                   for i in range(args.cpu_requests)]
        gaps_ms: list[float] = []
        lock = threading.Lock()

        def follow(tokens: list[int], responses) -> None:
            last = None  # the first message's delay is the resume latency, not an inter-token gap
            for response in responses:
                now = time.perf_counter()
                if response.token_ids:
                    if last is not None:
                        with lock:
                            gaps_ms.append((now - last) * 1e3 / len(response.token_ids))
                    last = now
                if response.finish_reason:
                    return

        busy = threading.Thread(target=keep_gpu_busy)
        busy.start()
        followers = [threading.Thread(target=follow, args=s) for s in streams]
        for thread in followers:
            thread.start()
        for thread in followers:
            thread.join(args.timeout_s)
        stop_prefills.set()
        busy.join(args.timeout_s)
    finally:
        cpu_daemon.stop()
        gpu_daemon.stop()
    return {
        "policy": policy,
        "cpu_requests": args.cpu_requests,
        "itl_samples": len(gaps_ms),
        "itl_p50_ms": round(statistics.median(gaps_ms), 2),
        "itl_p99_ms": round(percentile(gaps_ms, 99), 2),
        "itl_max_ms": round(max(gaps_ms), 2),
        "gpu_prefills_served": len(prefill_s),
        "gpu_prefill_mean_s": round(statistics.mean(prefill_s), 3) if prefill_s else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--cpu-requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="prompt length of each GPU prefill")
    parser.add_argument("--max-prefills", type=int, default=200, help="bound on the background prefills")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [run_policy(args, policy) for policy in ("dualpace", "gated")]
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    print("| policy | CPU-resident ITL P50 ms | P99 ms | max ms | GPU prefills served | mean prefill s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['itl_p50_ms']} | {r['itl_p99_ms']} | {r['itl_max_ms']} | "
              f"{r['gpu_prefills_served']} | {r['gpu_prefill_mean_s']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
