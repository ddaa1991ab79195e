"""Where one layer's ring round trip of a joined iteration goes, without the daemons: two
processes, each pinned to its own core (where there are two), exchange q/k/v and attention
outputs of the default model's shapes through a real shared-memory ring (dualpace/engine/assist/shm_ring.py)
in the pattern of a gated joined step: the "GPU" side posts a layer's q/k/v, works `--cover-us`
(S0's layer), waits for the answer, works `--post-us` (the joined rows' dense work); the "CPU"
side waits for the q/k/v, works `--attend-us`, posts the output. The variants of the CPU side's
wait (`spin:US`: the doorbell's spin of US µs, then a futex sleep until the post wakes it, as
before session 11; `ahead:US`: cpu_service's wait, ring_pacing.WakeAhead: sleep until shortly
before the q/k/v are due, then spin) alternate in blocks of `--block` layers in the same two
processes, so each variant sees the same minutes of the host's load.

    python -m bench.ring_wakeup --layers 4000 --variants spin:200,ahead:200
    python -m bench.ring_wakeup --cover-us 700 --variants spin:200,spin:1500,ahead:200 --out wake.json

Per variant, µs per layer (p50 / p90 / mean): the hop down split into *wake* (q/k/v posted ->
the CPU side's doorbell wait saw them; after a futex sleep also less
the CPU thread's time runnable without a core over its wait, i.e. the kernel's and hypervisor's
part) and *after wake* (-> the CPU side's Python had them: the GIL, the receive's Python), the GPU's wait (its receive call, as
gpu_service's step counts it) and the hop up; and how often each side's wait slept on the futex.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time

import torch

from dualpace.engine.assist.assist_types import ShmSlotKind
from dualpace.engine.assist.ring_pacing import WakeAhead
from dualpace.engine.assist.shm_doorbell import DEFAULT_SPIN_S
from dualpace.engine.run_delay import runqueue_wait_ns
from dualpace.engine.assist.shm_ring import ShmSegment

QKV_STAMP = struct.Struct("=q")  # the GPU side: q/k/v posted
# the CPU side: its wait saw them (0: already there), its Python had them, output posted, its wait
# slept, its thread runnable without a core over the wait (run_delay.py)
OUT_STAMP = struct.Struct("=qqqqq")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # the default model's attention shapes (SmolLM2-135M)


def busy(duration_s: float) -> None:
    until = time.perf_counter() + duration_s
    while time.perf_counter() < until:
        pass


def variant_of(layer: int, variants: list[tuple[bool, float]], block: int) -> tuple[bool, float]:
    return variants[(layer // block) % len(variants)]


def parse_variants(text: str) -> list[tuple[bool, float]]:
    """"spin:200,ahead" -> [(wake ahead, spin_s)]; the spin defaults to the doorbell's."""
    out = []
    for item in text.split(","):
        name, _, spin = item.partition(":")
        if name not in ("spin", "ahead"):
            raise SystemExit(f"unknown variant {name!r} (spin or ahead)")
        out.append((name == "ahead", float(spin) * 1e-6 if spin else DEFAULT_SPIN_S))
    return out


def pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > core:
        os.sched_setaffinity(0, {core})


def cpu_side(args) -> None:
    """The CPU engine's side (this process): answer each layer after --attend-us of work."""
    pin(1)
    variants = parse_variants(args.variants)
    segment = ShmSegment.create(2, args.slot_bytes)
    endpoint = segment.endpoint("up", variants[0][1])
    child = subprocess.Popen([sys.executable, "-m", "bench.ring_wakeup", "--gpu-side", segment.peer_path,
                              str(segment.size_bytes), segment.client_token.hex(), *sys.argv[1:]],
                             stdout=subprocess.PIPE, text=True)
    try:
        output = torch.zeros(args.batch, HEADS * HEAD_DIM, dtype=torch.bfloat16)
        ahead = None
        for layer in range(args.layers):
            wake_ahead, spin_s = variant_of(layer, variants, args.block)
            if layer % args.layers_per_iteration == 0:  # a new iteration: its own gaps (as cpu_service)
                ahead = WakeAhead(int(spin_s * 1e9))
            sleep_first_s = ahead.sleep_first_ns() / 1e9 if wake_ahead else 0.0
            spin_s = ahead.spin_ns() / 1e9 if wake_ahead else spin_s
            sleeps_before, runqueue_before_ns = endpoint.incoming.num_sleeps, runqueue_wait_ns()
            message = endpoint.receive(time.monotonic() + 30.0, sleep_first_s=sleep_first_s, spin_s=spin_s)
            had_ns = time.monotonic_ns()
            runqueue_ns = runqueue_wait_ns() - runqueue_before_ns
            if message is None:
                raise SystemExit("the GPU side did not send")
            busy(args.attend_us * 1e-6)
            posted_ns = time.monotonic_ns()
            endpoint.send_parts(ShmSlotKind.ATTENTION_OUTPUT, 1, layer, (output,),
                                OUT_STAMP.pack(endpoint.incoming.seen_ns, had_ns, posted_ns,
                                               endpoint.incoming.num_sleeps - sleeps_before, runqueue_ns))
            ahead.seen(had_ns)
            ahead.posted(posted_ns)
        report, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        segment.close()
    line = report.strip().splitlines()[-1]
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)


def gpu_side(args, path: str, size_bytes: int, token_hex: str) -> None:
    """The GPU engine's side (the child): post, cover, wait, post-work; all marks are kept here."""
    pin(0)
    variants = parse_variants(args.variants)
    segment = ShmSegment.open(path, size_bytes, bytes.fromhex(token_hex))
    endpoint = segment.endpoint("down", DEFAULT_SPIN_S)
    q = torch.randn(args.batch, HEADS, HEAD_DIM).to(torch.bfloat16)
    k = torch.randn(args.batch, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    v = k.clone()
    rows: dict[int, list[tuple]] = {index: [] for index in range(len(variants))}
    for layer in range(args.layers):
        sent_ns = time.monotonic_ns()
        endpoint.send_parts(ShmSlotKind.QKV, 1, layer, (q, k, v), QKV_STAMP.pack(sent_ns))
        busy(args.cover_us * 1e-6)
        sleeps_before = endpoint.incoming.num_sleeps
        wait_start_ns = time.monotonic_ns()
        message = endpoint.receive(time.monotonic() + 30.0)
        received_ns = time.monotonic_ns()
        if message is None:
            raise SystemExit("the CPU side did not answer")
        cpu_seen_ns, cpu_had_ns, posted_ns, cpu_sleeps, cpu_runqueue_ns = OUT_STAMP.unpack(message.payload)
        if layer >= args.warmup:
            rows[(layer // args.block) % len(variants)].append((
                sent_ns, cpu_seen_ns, cpu_had_ns, posted_ns, wait_start_ns, received_ns,
                endpoint.incoming.num_sleeps - sleeps_before, cpu_sleeps, cpu_runqueue_ns))
        busy(args.post_us * 1e-6)
    segment.close()
    print(json.dumps(summarize(rows, variants, args)))


def _stats(values_ns: list[int]) -> dict:
    if not values_ns:
        return {}
    ordered = sorted(values_ns)
    pick = lambda p: round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] / 1e3, 1)  # noqa: E731
    return {"p25_us": pick(0.25), "p50_us": pick(0.5), "p90_us": pick(0.9), "mean_us": round(sum(ordered) / len(ordered) / 1e3, 1)}


def summarize(rows: dict, variants: list[tuple[bool, float]], args) -> dict:
    out = {"layers_per_variant": {}, "args": {k: getattr(args, k) for k in
                                               ("cover_us", "attend_us", "post_us", "batch", "layers", "block",
                                                "layers_per_iteration")}}
    for index, (wake_ahead, spin_s) in enumerate(variants):
        name = f"{'ahead' if wake_ahead else 'spin'}:{round(spin_s * 1e6)}"
        marks = rows[index]
        woke = [r for r in marks if r[1]]  # the CPU side waited (its wait stamped when it saw them)
        out[name] = {
            "num_layers": len(marks),
            "down_hop": _stats([r[2] - r[0] for r in marks]),
            "down_hop_less_runqueue": _stats([max(0, r[2] - r[0] - r[8]) for r in marks]),
            "down_wake": _stats([r[1] - r[0] for r in woke]),
            "down_after_wake": _stats([r[2] - r[1] for r in woke]),
            "gpu_wait": _stats([r[5] - r[4] for r in marks]),
            "up_hop_when_late": _stats([r[5] - r[3] for r in marks if r[3] > r[4]]),
            "down_wake_after_sleep": _stats([r[1] - r[0] for r in woke if r[7]]),
            "down_wake_after_sleep_less_runqueue": _stats([max(0, r[1] - r[0] - r[8]) for r in woke if r[7]]),
            "cpu_runqueue_in_wait": _stats([r[8] for r in marks]),
            "down_wake_spinning": _stats([r[1] - r[0] for r in woke if not r[7]]),
            "cpu_wait_slept_share": round(sum(1 for r in marks if r[7]) / max(1, len(marks)), 3),
            "gpu_wait_slept_share": round(sum(1 for r in marks if r[6]) / max(1, len(marks)), 3),
        }
    out["load_1m"] = round(os.getloadavg()[0], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--block", type=int, default=120, help="layers per variant before the next one")
    parser.add_argument("--variants", default="spin:200,ahead:200", help="spin|ahead[:spin_us], comma-separated")
    parser.add_argument("--layers-per-iteration", type=int, default=30, help="the default model's layers")
    parser.add_argument("--cover-us", type=float, default=500.0)
    parser.add_argument("--attend-us", type=float, default=200.0)
    parser.add_argument("--post-us", type=float, default=100.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--slot-bytes", type=int, default=1 << 16)
    parser.add_argument("--out", default="")
    parser.add_argument("--gpu-side", nargs=3, metavar=("PATH", "SIZE", "TOKEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpu_side:
        gpu_side(args, args.gpu_side[0], int(args.gpu_side[1]), args.gpu_side[2])
        return
    cpu_side(args)


if __name__ == "__main__":
    main()
