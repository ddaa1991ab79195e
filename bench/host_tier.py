"""Three ways to serve a conversation's next turn whose history lives only in the host tier, in one run:
recompute it on the GPU engine, continue it on the CPU engine, or copy the history back to the GPU engine.

gpu_service (its pool kept small with --gpu-kv-blocks, so conversations evict each other
there; --host-tier names cpu_service), cpu_service (--peer gpu_service: the copy's target) and
two routers on the same engines, as real processes on Unix sockets: router *auto* with the
default host-tier rule (a suffix of at most 256 tokens continues on the CPU engine) and router
*copy* with --host-tier-max-suffix-tokens 1, so its rule copies the prefix back to the GPU
engine (CopyPrefix, then the GPU engine prefills only the suffix). Both with --no-migrate, so
no request moves mid-way. The multi-turn conversations of bench.load.workloads (each its own
opening of --opening-len tokens, a question, the model's reply, a second question). Closed
loop, one request at a time:

1. turn 1 of every conversation: placed on the GPU engine; when it finishes, gpu_service
   offers its cached blocks to cpu_service's pool (the host tier); the next conversations'
   turns evict it from the GPU engine's pool;
2. per conversation: a *cold* twin of turn 2 (the same lengths, its first token changed, so no
   engine caches any block of it: router auto places it on the GPU engine, which recomputes
   the whole prompt, as it would without a host tier); then the real turn 2 through router
   auto, which continues it on the CPU engine; then turn 2 with the first token of its
   question changed (the same history, so the same cached blocks as turn 2 found) through
   router copy, which copies the history back to the GPU engine and runs it there.

Reports per option TTFT per conversation, P50 TTFT, P50 ITL (per request: time after the first
token over the tokens after it) and throughput (output tokens over the summed request times), with the engine and cached tokens each request reported. A pause of
--settle-s after each request lets the background offer and the routers' KV events settle.
Writes bench/results/host_tier_<tag>.json and .md.

    python -m bench.host_tier --model smollm2-135m --dtype fp32 --tag smollm2-135m
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.load.generator import send_one as send
from bench.load.workloads import cold_twin, conversations
from bench.prefix_cache import add_engine_arguments, cpu_vector_flags, load_average, write_report
from dualpace.stats import percentile
from toolkit.processes import start_daemon


OPTIONS = ("recompute", "continue_on_cpu", "copy_to_gpu")
COPY_LINE = re.compile(r"copied (\d+) cached prompt tokens \((\d+) sent\) from \S+ to \S+ in ([\d.]+) ms")


def last_copy(router_log: str) -> dict | None:
    """The router's last CopyPrefix, from its log line: tokens copied, tokens sent, ms to the commit."""
    found = COPY_LINE.findall(router_log)
    if not found:
        return None
    num_tokens, num_sent, duration_ms = found[-1]
    return {"num_tokens": int(num_tokens), "num_sent_tokens": int(num_sent), "duration_ms": float(duration_ms)}


def start_daemons(args: argparse.Namespace, folder: Path) -> dict:
    gpu, cpu = f"unix:{folder / 'gpu.sock'}", f"unix:{folder / 'cpu.sock'}"
    engine = ("--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads))
    daemons = {"gpu": start_daemon("gpu_service", *engine, "--kv-blocks", str(args.gpu_kv_blocks), "--name", "gpu",
                                   "--host-tier", cpu, "--peer", cpu, listen=gpu)}
    daemons["cpu"] = start_daemon("cpu_service", *engine, "--name", "cpu", "--gpu-service", gpu, "--peer", gpu,
                                  listen=cpu)
    routing = ("serve", "--gpu", gpu, "--cpu", cpu, "--model", args.model, "--no-migrate")
    daemons["auto"] = start_daemon("router", *routing)
    daemons["copy"] = start_daemon("router", *routing, "--host-tier-max-suffix-tokens", "1")
    return daemons


def run(args: argparse.Namespace) -> dict:
    wargs = argparse.Namespace(workload="multi-turn", seed=args.seed, vocab_size=args.vocab_size, burstiness=1.0,
                               num_requests=args.num_conversations * 2, system_len=args.opening_len,
                               question_len=args.question_len, output_len=str(args.output_len), num_turns=2,
                               trace=None, input_len=None)
    plan = conversations(wargs, 1.0)
    folder = Path(tempfile.mkdtemp(prefix="dualpace-bench-host-tier-"))
    daemons = start_daemons(args, folder)
    auto, copy = daemons["auto"].address, daemons["copy"].address
    tag = str(int(time.time()))
    try:
        histories = []
        for conversation in plan:
            (question, n_out), _ = conversation.turns
            prompt = list(conversation.opening_token_ids) + list(question)
            first = send(auto, conversation.index * 4, prompt, n_out, tag)
            histories.append(prompt + first["output_token_ids"])
            time.sleep(args.settle_s)
        rows = []
        for conversation, history in zip(plan, histories):
            _, (question, n_out) = conversation.turns
            turn2 = history + list(question)
            cold = cold_twin(turn2, args.vocab_size)
            # The same history, another first question token: it shares exactly the cached blocks turn 2
            # found (not the blocks turn 2 itself then left in the CPU engine's cache).
            other_question = history + [question[0] % (args.vocab_size - 1) + 1] + list(question[1:])
            row = {"conversation": conversation.index}
            for offset, (option, router, prompt) in enumerate(
                    zip(OPTIONS, (auto, auto, copy), (cold, turn2, other_question)), start=1):
                row[option] = send(router, conversation.index * 4 + offset, prompt, n_out, tag)
                row[option].pop("output_token_ids")
                if option == "copy_to_gpu":
                    row[option]["copy"] = last_copy(daemons["copy"].log())
                time.sleep(args.settle_s)
            rows.append(row)
            print(f"conversation {conversation.index}: " + ", ".join(
                f"{o} {row[o]['ttft_ms']} ms on {row[o]['engines']} ({row[o]['cached_tokens']} cached)" for o in OPTIONS),
                file=sys.stderr, flush=True)
        return {"rows": rows}
    finally:
        for name in ("copy", "auto", "cpu", "gpu"):
            daemons[name].stop()
        shutil.rmtree(folder, ignore_errors=True)


def summary(rows: list[dict]) -> dict:
    out: dict = {"num_conversations": len(rows)}
    for option in OPTIONS:
        entries = [r[option] for r in rows]
        out[f"ttft_p50_{option}_ms"] = round(percentile([e["ttft_ms"] for e in entries], 50), 1)
        out[f"itl_p50_{option}_ms"] = round(percentile(
            [(e["e2e_ms"] - e["ttft_ms"]) / (e["num_output_tokens"] - 1) for e in entries if e["num_output_tokens"] > 1],
            50), 1)
        out[f"throughput_{option}_tok_s"] = round(
            sum(e["num_output_tokens"] for e in entries) / (sum(e["e2e_ms"] for e in entries) / 1e3), 2)
    # Served as intended: the first token from the CPU engine with cached KV, or from the GPU engine after a copy.
    out["num_continued_on_cpu"] = sum(r["continue_on_cpu"]["engines"][:1] == ["cpu"]
                                      and r["continue_on_cpu"]["cached_tokens"] > 0 for r in rows)
    out["num_copied_to_gpu"] = sum(r["copy_to_gpu"]["engines"][:1] == ["gpu"]
                                   and r["copy_to_gpu"]["cached_tokens"] > 0 for r in rows)
    copies = [r["copy_to_gpu"]["copy"] for r in rows if r["copy_to_gpu"].get("copy")]
    out["copy_p50_ms"] = round(percentile([c["duration_ms"] for c in copies], 50), 1) if copies else None
    out["copy_p50_tokens"] = percentile([c["num_tokens"] for c in copies], 50) if copies else None
    for option in OPTIONS[1:]:
        out[f"ratio_{option}_over_recompute"] = round(out[f"ttft_p50_{option}_ms"] / out["ttft_p50_recompute_ms"], 3)
    return out


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [f"Host tier: recompute vs continue on CPU vs copy back — {report['config']['model']} "
             f"({report['config']['dtype']}), CPU {report['cpu']}, load before {report['load_before']} "
             f"after {report['load_after']}", "",
             "| conversation | turn-2 tokens | recompute TTFT ms (engine, cached) | continue on CPU TTFT ms "
             "(engine, cached) | copy to GPU TTFT ms (engine, cached) |", "|---|---|---|---|---|"]
    for row in report["rows"]:
        cells = [f"{row[o]['ttft_ms']} ({'/'.join(row[o]['engines'])}, {row[o]['cached_tokens']})" for o in OPTIONS]
        lines.append(f"| {row['conversation']} | {row['continue_on_cpu']['prompt_tokens']} | " + " | ".join(cells) + " |")
    lines += ["", "| option | P50 TTFT ms | ratio to recompute | P50 ITL ms | throughput tok/s |", "|---|---|---|---|---|"]
    for option in OPTIONS:
        ratio = s.get(f"ratio_{option}_over_recompute", 1.0)
        lines.append(f"| {option} | {s[f'ttft_p50_{option}_ms']} | {ratio} | {s[f'itl_p50_{option}_ms']} | "
                     f"{s[f'throughput_{option}_tok_s']} |")
    lines += ["", f"Copy back: P50 {s['copy_p50_ms']} ms from the router's CopyPrefix call to the GPU engine's "
                  f"commit, for a P50 of {s['copy_p50_tokens']} tokens (inside the copy_to_gpu TTFT)."]
    lines += ["", f"{s['num_continued_on_cpu']} of {s['num_conversations']} continued on the CPU engine from the "
                  f"host tier, {s['num_copied_to_gpu']} copied back and served by the GPU engine from the copy."]
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
    rows = run(args)["rows"]
    report = {"config": vars(args), "cpu": cpu, "load_before": load_before, "load_after": load_average(),
              "rows": rows, "summary": summary(rows)}
    write_report(report, f"host_tier_{args.tag}", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
