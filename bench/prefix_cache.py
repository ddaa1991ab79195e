"""Prefix caching on vs off: the same seeded chat traces through `dualpace up`, in one run.

For each setting (off first, then on) a fresh `dualpace up --prefix-caching SETTING` is started
(gpu_service, cpu_service and the router as real processes on 127.0.0.1), and the two chat
workloads of bench.load.workloads run against it: shared-prefix (one system prompt, many
questions) and multi-turn (conversations resending their history). Greedy outputs must be
identical between the settings (checked and reported). With --solo-turns (default) each setting then
runs fresh conversations closed loop: with caching on, every later turn is paired with a solo
twin of its uncached tokens alone, to compare their TTFTs (below). Writes
bench/results/prefix_cache_<tag>.json and a markdown table: TTFT, ITL, throughput, hit rate, and the
ratios on / off.

    python -m bench.prefix_cache --model smollm2-135m --dtype fp32 --tag smollm2-135m

The solo turns. With prefix caching on, a conversation's later turn finds its history cached by the earlier
turns and prefills only what is new (the previous reply's last tokens and the new question). The
question "is its TTFT close to those tokens' prefill alone?" is answered pair by pair, one
request at a time, so that load drift on a shared machine hits both sides of a pair alike:

1. the real turn (turn >= 2: the whole history plus its question): TTFT and usage.cached_tokens;
2. right after it, its *solo* twin: a cold prompt of exactly the turn's uncached length (prompt
   tokens - cached tokens), the turn's own new tokens with the first one changed
   (bench.load.workloads.cold_twin), so it shares no block with any cached prefix (checked:
   its cached_tokens must be 0), the same max_tokens.

Reported per pair and as medians: TTFT of each side and the ratio turn / solo. With caching off
the same conversations run without twins, to check the greedy outputs on vs off.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from bench.load.conversations import run_workload_records, workload_summary
from bench.load.generator import send_one
from bench.load.workloads import Conversation, cold_twin, conversations
from dualpace.stats import percentile
from toolkit.processes import start_up

SETTINGS = ("off", "on")
SOLO_SEED_OFFSET = 7919  # the solo phase's conversations: not the multi-turn workload's, already cached


def solo_prompt(turn_prompt_ids: list[int], num_cached_tokens: int, vocab_size: int) -> list[int]:
    """The turn's uncached tokens (at least one: an engine always computes the last prompt token),
    as a cold twin: they start a prompt of their own and their first token is changed."""
    if not 0 <= num_cached_tokens <= len(turn_prompt_ids):
        raise ValueError(f"{num_cached_tokens} cached tokens for a prompt of {len(turn_prompt_ids)}")
    start = min(num_cached_tokens, len(turn_prompt_ids) - 1)
    return cold_twin(list(turn_prompt_ids[start:]), vocab_size)


def pair_row(conversation: int, turn: int, real: dict, solo: dict) -> dict:
    """One pair's line: valid when the turn reused cached tokens, the solo twin reused none, and the
    first token of both came from the same engine (else it compares engines, not prefills)."""
    valid = (real["cached_tokens"] > 0 and solo["cached_tokens"] == 0
             and real["engines"][:1] == solo["engines"][:1])
    return {"conversation": conversation, "turn": turn, "prompt_tokens": real["prompt_tokens"],
            "cached_tokens": real["cached_tokens"], "new_tokens": solo["prompt_tokens"],
            "turn_ttft_ms": real["ttft_ms"], "solo_ttft_ms": solo["ttft_ms"],
            "solo_cached_tokens": solo["cached_tokens"], "turn_engines": real["engines"],
            "solo_engines": solo["engines"], "ratio": round(real["ttft_ms"] / solo["ttft_ms"], 3)
            if solo["ttft_ms"] > 0 else None, "valid": valid}


def solo_summary(pairs: list[dict]) -> dict:
    """Medians over the valid pairs: each side's TTFT and the per-pair ratio turn / solo."""
    valid = [p for p in pairs if p["valid"] and p["ratio"] is not None]

    def median(key: str) -> float | None:
        return round(percentile([p[key] for p in valid], 50), 3) if valid else None

    return {"num_pairs": len(pairs), "num_valid_pairs": len(valid), "turn_ttft_p50_ms": median("turn_ttft_ms"),
            "solo_ttft_p50_ms": median("solo_ttft_ms"), "ratio_p50": median("ratio"),
            "ratio_min": min((p["ratio"] for p in valid), default=None),
            "ratio_max": max((p["ratio"] for p in valid), default=None)}


def run_solo_turns(router: str, plan: list[Conversation], vocab_size: int, *, with_solo: bool, tag: str) -> dict:
    """Every conversation's turns in order, one request at a time (each turn's history the replies actually
    generated), and after each later turn its solo twin when with_solo. Returns the pairs, the
    turns' outputs by request index and the cached tokens turn 1 found (0: fresh conversations)."""
    num_turns = max((len(c.turns) for c in plan), default=0)
    pairs, outputs, first_turn_cached = [], {}, []
    for conversation in plan:
        history = list(conversation.opening_token_ids)
        for turn, (question, output_len) in enumerate(conversation.turns, start=1):
            prompt = history + list(question)
            index = 2 * (conversation.index * num_turns + turn - 1)
            real = send_one(router, index, prompt, output_len, tag)
            outputs[index] = real.pop("output_token_ids")
            history = prompt + outputs[index]
            if turn == 1:
                first_turn_cached.append(real["cached_tokens"])
            elif with_solo:
                solo = send_one(router, index + 1, solo_prompt(prompt, real["cached_tokens"], vocab_size),
                                output_len, tag)
                solo.pop("output_token_ids")
                pairs.append(pair_row(conversation.index, turn, real, solo))
    return {"pairs": pairs, "outputs": outputs, "first_turn_cached_tokens": first_turn_cached}


def solo_markdown(solo: dict) -> list[str]:
    """The pairs table and the medians, as lines of the prefix-cache report."""
    s = solo["summary"]
    lines = ["", "Multi-turn later turns vs their new tokens alone (caching on, closed loop, pairs interleaved)", "",
             "| conversation | turn | prompt tokens | cached | new tokens | turn TTFT ms | solo TTFT ms "
             "| solo cached | ratio turn/solo | engines turn / solo | valid |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in solo["pairs"]:
        lines.append(f"| {p['conversation']} | {p['turn']} | {p['prompt_tokens']} | {p['cached_tokens']} | "
                     f"{p['new_tokens']} | {p['turn_ttft_ms']} | {p['solo_ttft_ms']} | {p['solo_cached_tokens']} | "
                     f"{p['ratio']} | {'/'.join(p['turn_engines'])} / {'/'.join(p['solo_engines'])} | {p['valid']} |")
    lines += ["", f"{s['num_valid_pairs']} of {s['num_pairs']} pairs valid; medians: turn TTFT {s['turn_ttft_p50_ms']} "
                  f"ms, solo TTFT {s['solo_ttft_p50_ms']} ms, ratio turn/solo {s['ratio_p50']} "
                  f"(range {s['ratio_min']}-{s['ratio_max']}); turn 1 cached tokens {solo['first_turn_cached_tokens']}; "
                  f"outputs identical on/off: {solo.get('outputs_identical')}"]
    return lines


def workload_args(args: argparse.Namespace, router: str, workload: str) -> argparse.Namespace:
    shared = workload == "shared-prefix"
    return argparse.Namespace(
        router=router, workload=workload, seed=args.seed, vocab_size=args.vocab_size, burstiness=1.0,
        num_requests=args.num_requests if shared else args.num_conversations * args.num_turns,
        system_len=args.system_len if shared else args.opening_len, question_len=args.question_len,
        output_len=args.output_len, num_turns=args.num_turns, trace=None, input_len=None,
        max_concurrency=None, timeout_s=args.timeout_s, slo_ttft_ms=None, slo_itl_ms=None)


def run_setting(args: argparse.Namespace, setting: str) -> dict:
    up = start_up("--model", args.model, "--dtype", args.dtype, "--prefix-caching", setting,
                  "--threads-per-engine", str(args.threads), timeout_s=300.0)
    router = up.address
    try:
        out = {}
        for workload, rate in (("shared-prefix", args.rate), ("multi-turn", args.conversation_rate)):
            wargs = workload_args(args, router, workload)
            result, planned = run_workload_records(wargs, rate, run_tag=f"{setting}-{int(time.time())}")
            summary = workload_summary(wargs, result, planned)
            out[workload] = {"summary": summary,
                             "outputs": {r.index: r.output_token_ids for r in result.records if r.completed}}
            print(f"prefix caching {setting}, {workload}: TTFT P50 {summary['ttft']['p50_ms']} ms, "
                  f"hit rate {summary['prefix_cache_hit_rate']}, {summary['accounting']['line']}",
                  file=sys.stderr, flush=True)
        if args.solo_turns:
            wargs = workload_args(args, router, "multi-turn")
            wargs.seed = args.seed + SOLO_SEED_OFFSET
            out["solo"] = run_solo_turns(router, conversations(wargs, 1.0), args.vocab_size, with_solo=setting == "on",
                                         tag=f"solo-{setting}-{int(time.time())}")
            print(f"prefix caching {setting}, solo turns: {solo_summary(out['solo']['pairs'])}", file=sys.stderr,
                  flush=True)
        return out
    finally:
        up.stop(timeout_s=60.0)


def ratio(on, off) -> float | None:
    return None if on is None or not off else round(on / off, 3)


def markdown(report: dict) -> str:
    lines = [f"Prefix caching on vs off — {report['config']['model']} ({report['config']['dtype']}), "
             f"CPU {report['cpu']}, load before {report['load_before']} after {report['load_after']}", "",
             "| workload | caching | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | ITL P99 ms | output tok/s "
             "| req/s | hit rate | TTFT P50 by turn (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for workload, by_setting in report["runs"].items():
        for setting in SETTINGS:
            s = by_setting[setting]["summary"]
            turns = s.get("ttft_p50_ms_by_turn", "")
            lines.append(f"| {workload} | {setting} | {s['ttft']['p50_ms']} | {s['ttft']['p99_ms']} | "
                         f"{s['itl']['p50_ms']} | {s['itl']['p99_ms']} | {s['output_token_throughput_tps']} | "
                         f"{s['request_throughput_rps']} | {s['prefix_cache_hit_rate']} | {turns} |")
    lines += ["", "| workload | TTFT P50 on/off | output throughput on/off | outputs identical |", "|---|---|---|---|"]
    for workload, ratios in report["ratios"].items():
        lines.append(f"| {workload} | {ratios['ttft_p50']} | {ratios['output_throughput']} | "
                     f"{ratios['outputs_identical']} |")
    if "solo_turns" in report:
        lines += solo_markdown(report["solo_turns"])
    return "\n".join(lines) + "\n"


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --dtype and --threads, as these chat benchmarks start `dualpace up`."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32", choices=["auto", "fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")


def cpu_vector_flags() -> str:
    """This CPU's AVX2 / AVX-512 / AMX flags, as the reports name the machine."""
    flags = sorted(set(re.findall(r"\b(avx512[a-z_0-9]*|avx2|fma|f16c|amx[a-z_0-9]*)\b", Path("/proc/cpuinfo").read_text())))
    return " ".join(flags) + ("" if any(f.startswith("avx512") for f in flags) else ", no AVX-512")


def write_report(report: dict, name: str, text: str) -> None:
    """bench/results/NAME.json (the report) and NAME.md (its table, also printed)."""
    out = Path("bench/results") / f"{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)


def load_average() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    p.add_argument("--num-requests", type=int, default=8, help="shared-prefix requests")
    p.add_argument("--rate", type=float, default=0.5, help="shared-prefix arrivals per second")
    p.add_argument("--system-len", type=int, default=1000, help="shared-prefix: the shared system prompt")
    p.add_argument("--num-conversations", type=int, default=3)
    p.add_argument("--num-turns", type=int, default=3)
    p.add_argument("--conversation-rate", type=float, default=0.2, help="multi-turn: conversation starts per second")
    p.add_argument("--opening-len", type=int, default=400, help="multi-turn: each conversation's first message")
    p.add_argument("--question-len", default="16:48")
    p.add_argument("--output-len", default="16")
    p.add_argument("--vocab-size", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per workload and setting")
    p.add_argument("--solo-turns", action=argparse.BooleanOptionalAction, default=True,
                   help="also pair each later multi-turn turn with its new tokens alone")
    p.add_argument("--tag", default="smollm2-135m")
    args = p.parse_args(argv)
    cpu, load_before = cpu_vector_flags(), load_average()
    runs_by_setting = {setting: run_setting(args, setting) for setting in SETTINGS}
    runs, ratios = {}, {}
    for workload in ("shared-prefix", "multi-turn"):
        off, on = (runs_by_setting[s][workload] for s in SETTINGS)
        runs[workload] = {s: {"summary": runs_by_setting[s][workload]["summary"]} for s in SETTINGS}
        ratios[workload] = {
            "ttft_p50": ratio(on["summary"]["ttft"]["p50_ms"], off["summary"]["ttft"]["p50_ms"]),
            "output_throughput": ratio(on["summary"]["output_token_throughput_tps"],
                                       off["summary"]["output_token_throughput_tps"]),
            "outputs_identical": on["outputs"] == off["outputs"] and len(on["outputs"]) > 0,
        }
    report = {"config": vars(args), "cpu": cpu, "load_before": load_before,
              "load_after": load_average(), "runs": runs, "ratios": ratios}
    if args.solo_turns:
        off, on = (runs_by_setting[s]["solo"] for s in SETTINGS)
        report["solo_turns"] = {"seed": args.seed + SOLO_SEED_OFFSET, "pairs": on["pairs"],
                                "summary": solo_summary(on["pairs"]),
                                "first_turn_cached_tokens": on["first_turn_cached_tokens"],
                                "outputs_identical": on["outputs"] == off["outputs"] and len(on["outputs"]) > 0}
    write_report(report, f"prefix_cache_{args.tag}", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
