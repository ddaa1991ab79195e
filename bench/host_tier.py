"""A conversation continued on the CPU engine from the host tier vs recomputing it, in one run.

One `dualpace up` (gpu_service, cpu_service and the router as real processes; the GPU
engine's pool kept small with --gpu-kv-blocks, so conversations evict each other there) and
the multi-turn conversations of bench.load.workloads (each its own opening of --opening-len
tokens, a question, the model's reply, a second question). Closed loop, one request at a time:

1. turn 1 of every conversation: placed on the GPU engine; when it finishes, gpu_service
   offers its cached blocks to cpu_service's pool (the host tier); the next conversations'
   turns evict it from the GPU engine's pool;
2. per conversation, alternately: a *cold* twin of turn 2 (the same lengths, its first token
   changed, so no engine caches any block of it: the router places it on the GPU engine,
   which recomputes the whole prompt, as it would for turn 2 without a host tier), then the
   real turn 2, which the router continues on the CPU engine from the host tier (its usage
   reports the cached tokens; only the new tokens are prefilled).

Reports TTFT of both per conversation and the ratio of their medians (host tier / recompute),
with the engine and cached tokens each request reported. A pause of --settle-s after each
request lets the background offer and the router's KV events settle, so requests do not
overlap with them. Writes bench/results/host_tier_<tag>.json and .md.

    python -m bench.host_tier --model smollm2-135m --dtype fp32 --tag smollm2-135m
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from bench.load.generator import run_load
from bench.load.workloads import conversations
from bench.prefix_cache import add_engine_arguments, cpu_vector_flags, load_average, write_report
from dualpace.stats import percentile
from toolkit.processes import start_up
from toolkit.workload import RequestSpec


def send(router: str, index: int, prompt: list[int], output_len: int, tag: str) -> dict:
    result = asyncio.run(run_load(router, [RequestSpec(index, 0.0, tuple(prompt), output_len)], timeout_s=600.0,
                                  run_tag=tag))
    record = result.records[0]
    if not record.completed:
        raise SystemExit(f"request {index} failed: {record.status} {record.detail}")
    ttft = record.ttft_s()
    return {"prompt_tokens": len(prompt), "ttft_ms": round(ttft * 1e3, 2), "engines": record.engines,
            "cached_tokens": record.num_cached_tokens, "output_token_ids": record.output_token_ids}


def run(args: argparse.Namespace) -> dict:
    wargs = argparse.Namespace(workload="multi-turn", seed=args.seed, vocab_size=args.vocab_size, burstiness=1.0,
                               num_requests=args.num_conversations * 2, system_len=args.opening_len,
                               question_len=args.question_len, output_len=str(args.output_len), num_turns=2,
                               trace=None, input_len=None)
    plan = conversations(wargs, 1.0)
    up = start_up("--model", args.model, "--dtype", args.dtype, "--gpu-kv-blocks", str(args.gpu_kv_blocks),
                  "--threads-per-engine", str(args.threads), timeout_s=300.0)
    tag = str(int(time.time()))
    try:
        histories = []
        for conversation in plan:
            (question, n_out), _ = conversation.turns
            prompt = list(conversation.opening_token_ids) + list(question)
            first = send(up.address, conversation.index * 3, prompt, n_out, tag)
            histories.append(prompt + first["output_token_ids"])
            time.sleep(args.settle_s)
        pairs = []
        for conversation, history in zip(plan, histories):
            _, (question, n_out) = conversation.turns
            turn2 = history + list(question)
            cold = [turn2[0] % (args.vocab_size - 1) + 1] + turn2[1:]
            recompute = send(up.address, conversation.index * 3 + 1, cold, n_out, tag)
            time.sleep(args.settle_s)
            continued = send(up.address, conversation.index * 3 + 2, turn2, n_out, tag)
            time.sleep(args.settle_s)
            for entry in (recompute, continued):
                entry.pop("output_token_ids")
            pairs.append({"conversation": conversation.index, "recompute": recompute, "host_tier": continued})
            print(f"conversation {conversation.index}: recompute {recompute['ttft_ms']} ms on "
                  f"{recompute['engines']} ({recompute['cached_tokens']} cached), host tier {continued['ttft_ms']} ms "
                  f"on {continued['engines']} ({continued['cached_tokens']} cached)", file=sys.stderr, flush=True)
        return {"pairs": pairs}
    finally:
        up.stop(timeout_s=60.0)


def summary(pairs: list[dict]) -> dict:
    # The first token came from the CPU engine, from cached KV (the planner may move it to the GPU later).
    on_cpu = [p for p in pairs if p["host_tier"]["engines"][:1] == ["cpu"] and p["host_tier"]["cached_tokens"] > 0]
    hit = percentile([p["host_tier"]["ttft_ms"] for p in on_cpu], 50) if on_cpu else None
    cold = percentile([p["recompute"]["ttft_ms"] for p in on_cpu], 50) if on_cpu else None
    return {"num_pairs": len(pairs), "num_continued_on_cpu_from_host_tier": len(on_cpu),
            "ttft_p50_host_tier_ms": hit, "ttft_p50_recompute_ms": cold,
            "ratio_host_tier_over_recompute": round(hit / cold, 3) if hit and cold else None}


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [f"Host tier vs recompute — {report['config']['model']} ({report['config']['dtype']}), CPU {report['cpu']}, "
             f"load before {report['load_before']} after {report['load_after']}", "",
             "| conversation | turn-2 tokens | recompute TTFT ms (engine, cached) | host tier TTFT ms (engine, cached) |",
             "|---|---|---|---|"]
    for p in report["pairs"]:
        r, h = p["recompute"], p["host_tier"]
        lines.append(f"| {p['conversation']} | {h['prompt_tokens']} | {r['ttft_ms']} ({'/'.join(r['engines'])}, "
                     f"{r['cached_tokens']}) | {h['ttft_ms']} ({'/'.join(h['engines'])}, {h['cached_tokens']}) |")
    lines += ["", f"P50 TTFT: host tier {s['ttft_p50_host_tier_ms']} ms, recompute {s['ttft_p50_recompute_ms']} ms, "
                  f"ratio **{s['ratio_host_tier_over_recompute']}** ({s['num_continued_on_cpu_from_host_tier']} of "
                  f"{s['num_pairs']} turns continued on the CPU engine from the host tier)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    p.add_argument("--gpu-kv-blocks", type=int, default=40, help="the GPU engine's small pool (16-token blocks)")
    p.add_argument("--num-conversations", type=int, default=4)
    p.add_argument("--opening-len", type=int, default=400, help="each conversation's first message")
    p.add_argument("--question-len", default="16:48")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle-s", type=float, default=1.5, help="pause after each request")
    p.add_argument("--tag", default="smollm2-135m")
    args = p.parse_args(argv)
    cpu, load_before = cpu_vector_flags(), load_average()
    pairs = run(args)["pairs"]
    report = {"config": vars(args), "cpu": cpu, "load_before": load_before, "load_after": load_average(),
              "pairs": pairs, "summary": summary(pairs)}
    write_report(report, f"host_tier_{args.tag}", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
