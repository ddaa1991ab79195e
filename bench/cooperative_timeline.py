"""Check gated's two points on the daemons' step timelines (`--step-timeline PATH` on
gpu_service and cpu_service):

1. **CPU requests advance only inside GPU iterations** (`--policy gated`): every CPU-engine record
   of a decode iteration is `cooperative`, names the GPU step that made its tokens
   (`engine_step_id`), and that GPU step's record lists this iteration among its joins. It is an
   identity check, not a timing one: the GPU record must carry the same (peer, iteration_id), and
   each GPU join is claimed by one CPU record only, one CPU engine per peer. Under
   `--policy dualpace` local and staged iterations are allowed; the cooperative ones are checked.
2. **The GPU is not idle while the CPU attends**: the GPU's wait on the CPU (Σ `gpu_wait_ns` of GPU
   steps with own rows and joins) over the CPU's attention time of the joins in those steps
   (Σ `attention_ns`); target below 5%. The held gated baseline is 100% by construction. Also
   reported: the same wait over those GPU steps' length (how much of the GPU's time it idled),
   and the wait split in two, per GPU step: the CPU's attention that the GPU's own overlapping work
   (`cover_ns`: S0's layers and D1's attention) was too short to hide, `max(0, attention - cover)`,
   which no transport could remove; and the rest, `wait - that`: ring hops, wake-ups of either
   process and time without a core (transport and scheduling).

Beside the verdict it reports the intervals: how long a CPU iteration waited for its GPU step to
begin, the GPU step's length, and the tail after the GPU step until the CPU iteration ended.

    python -m bench.cooperative_timeline --gpu gpu.jsonl --cpu cpu.jsonl --policy gated
Exit status: 0 both points pass, 1 a point fails, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.load.stats import distribution_ms
from dualpace.engine.step_timeline import StepRecord, read_timeline
from dualpace.errors import DualPaceError
from dualpace.policy.policies import CPU_SERVICE_POLICY_NAMES, Policy, traits

DEFAULT_MAX_WAIT_SHARE = 0.05
# The GPU records' per-layer round-trip stamps (dualpace/engine/assist/ring_pacing.py LayerMarks)
MARK_FIELDS = ("down_hop_ns", "cpu_layer_ns", "wait_before_answer_ns", "up_hop_ns")
NUM_EXAMPLES = 5  # failures quoted in the report


@dataclass
class TimelineCheck:
    policy: str
    num_gpu_steps: int = 0
    num_gpu_steps_with_joins: int = 0
    cpu_modes: Counter = field(default_factory=Counter)  # decode iterations by mode
    num_cpu_checked: int = 0  # CPU records held to point 1
    num_cpu_matched: int = 0
    failures: list[str] = field(default_factory=list)  # point 1, one line each
    num_unclaimed_joins: int = 0  # GPU joins no CPU record claims (a dropped join, a lost record)
    gpu_wait_ns: int = 0
    cpu_attention_ns: int = 0
    gpu_step_ns: int = 0  # Σ length of the GPU steps point 2 counts (own rows and joins)
    cover_ns: int = 0  # Σ of those steps' work overlapping the CPU's attention (0: not recorded)
    uncovered_ns: int = 0  # Σ max(0, attention - cover) per step: attention longer than the GPU's own work
    transport_ns: int = 0  # Σ max(0, wait - uncovered) per step: ring hops, wake-ups, no core
    wait_and_attention_ns_by_how: dict = field(default_factory=dict)  # how -> [Σ GPU wait, Σ CPU attention]
    join_wait_s: list[float] = field(default_factory=list)  # CPU iteration start -> its GPU step start
    gpu_step_s: list[float] = field(default_factory=list)
    tail_s: list[float] = field(default_factory=list)  # GPU step end -> CPU iteration end
    # Σ of MARK_FIELDS, num_marked_layers, num_wait_sleeps, num_long_waits, long_wait_ns over the counted GPU
    # steps; gpu_runqueue_ns / cpu_runqueue_ns: their threads' time runnable without a core (GPU steps, CPU iterations)
    marks: Counter = field(default_factory=Counter)
    max_wait_share: float = DEFAULT_MAX_WAIT_SHARE

    @property
    def advance_only_inside_gpu(self) -> bool:
        return not self.failures and self.num_cpu_matched > 0

    @property
    def wait_share(self) -> float | None:
        return self.gpu_wait_ns / self.cpu_attention_ns if self.cpu_attention_ns > 0 else None

    @property
    def wait_share_of_steps(self) -> float | None:
        """The same wait over those GPU steps' own length: the part of the GPU's time it stood idle."""
        return self.gpu_wait_ns / self.gpu_step_ns if self.gpu_step_ns > 0 else None

    @property
    def gpu_not_idle(self) -> bool:
        share = self.wait_share
        return share is not None and share < self.max_wait_share

    @property
    def passed(self) -> bool:
        return self.advance_only_inside_gpu and self.gpu_not_idle

    def summary(self) -> dict:
        share = self.wait_share
        return {
            "policy": self.policy,
            "passed": self.passed,
            "advance_only_inside_gpu": self.advance_only_inside_gpu,
            "gpu_not_idle_while_cpu_attends": self.gpu_not_idle,
            "num_gpu_steps": self.num_gpu_steps,
            "num_gpu_steps_with_joins": self.num_gpu_steps_with_joins,
            "cpu_decode_iterations_by_mode": dict(sorted(self.cpu_modes.items())),
            "num_cpu_checked": self.num_cpu_checked,
            "num_cpu_matched": self.num_cpu_matched,
            "num_failures": len(self.failures),
            "failures": self.failures[:NUM_EXAMPLES],
            "num_unclaimed_joins": self.num_unclaimed_joins,
            "gpu_wait_ms": round(self.gpu_wait_ns / 1e6, 3),
            "cpu_attention_ms": round(self.cpu_attention_ns / 1e6, 3),
            "gpu_wait_share": None if share is None else round(share, 4),
            "gpu_step_ms": round(self.gpu_step_ns / 1e6, 3),
            "gpu_wait_share_of_steps": None if self.wait_share_of_steps is None else round(self.wait_share_of_steps, 4),
            "cover_ms": round(self.cover_ns / 1e6, 3),
            "gpu_wait_uncovered_ms": round(self.uncovered_ns / 1e6, 3),
            "gpu_wait_transport_ms": round(self.transport_ns / 1e6, 3),
            "gpu_wait_share_by_how": {how: round(wait / attention, 4) if attention else None
                                      for how, (wait, attention) in sorted(self.wait_and_attention_ns_by_how.items())},
            "max_wait_share": self.max_wait_share,
            "join_wait": distribution_ms(self.join_wait_s),
            "gpu_step": distribution_ms(self.gpu_step_s),
            "tail_after_gpu_step": distribution_ms(self.tail_s),
            "layer_marks": self.layer_marks(),
        }

    def layer_marks(self) -> dict:
        """Per stamped layer, means in µs: q/k/v post -> the CPU saw them (down hop), the CPU's own
        time, the GPU's wait before the CPU answered, the answer -> the GPU had it (up hop); and the
        share of the GPU's waits that slept on the futex."""
        layers = self.marks["num_marked_layers"]
        if not layers:
            return {"num_layers": 0}
        marks = self.marks
        means = {name.removesuffix("_ns") + "_us": round(marks[name] / layers / 1e3, 1) for name in MARK_FIELDS}
        return {"num_layers": layers, **means, "sleeps_per_layer": round(marks["num_wait_sleeps"] / layers, 3),
                "num_long_waits": marks["num_long_waits"], "long_wait_ms": round(marks["long_wait_ns"] / 1e6, 3),
                "gpu_runqueue_ms": round(marks["gpu_runqueue_ns"] / 1e6, 3),
                "cpu_runqueue_ms": round(marks["cpu_runqueue_ns"] / 1e6, 3)}


def check_timelines(gpu_records: list[StepRecord], cpu_records: list[StepRecord], policy: str = Policy.GATED.value,
                    max_wait_share: float = DEFAULT_MAX_WAIT_SHARE) -> TimelineCheck:
    """Both acceptance points over one GPU engine's records and any CPU engines' records."""
    check = TimelineCheck(policy, max_wait_share=max_wait_share)
    gpu_steps: dict[int, StepRecord] = {}
    repeated = Counter(record.step_id for record in gpu_records)
    for step_id, count in repeated.items():
        if count > 1:
            check.failures.append(f"GPU step {step_id} recorded {count} times")
    for record in gpu_records:
        gpu_steps.setdefault(record.step_id, record)  # the first: a repeat is the failure above
    check.num_gpu_steps = len(gpu_steps)
    check.num_gpu_steps_with_joins = sum(bool(r.joins) for r in gpu_steps.values())
    claimed: dict[tuple[str, int], str] = {}  # (peer, iteration_id) -> the CPU record that claimed it
    peer_of: dict[str, str] = {}  # GPU-side peer -> CPU engine
    attention_by_step: Counter = Counter()
    cpu_runqueue_by_step: Counter = Counter()
    for record in cpu_records:
        if not record.is_decode_only:
            continue  # prefills never join: they stay local or go to the GPU by hand-off
        check.cpu_modes[record.mode] += 1
        if record.mode != "cooperative" and not traits(policy).cpu_decodes_inside_gpu_steps:
            continue  # dualpace may run an iteration locally or staged
        check.num_cpu_checked += 1
        name = f"{record.engine} step {record.step_id}"
        if record.mode != "cooperative":
            check.failures.append(f"{name}: ran {record.mode}, not inside a GPU step")
            continue
        if record.engine_step_id is None or record.iteration_id is None:
            check.failures.append(f"{name}: cooperative but without a GPU step id or iteration id")
            continue
        gpu = gpu_steps.get(record.engine_step_id)
        if gpu is None:
            check.failures.append(f"{name}: GPU step {record.engine_step_id} is not in the GPU timeline")
            continue
        joins = [j for j in gpu.joins if j.iteration_id == record.iteration_id
                 and peer_of.get(j.peer, record.engine) == record.engine]
        if not joins:
            check.failures.append(f"{name}: iteration {record.iteration_id} is not among GPU step "
                                  f"{gpu.step_id}'s joins {[(j.peer, j.iteration_id) for j in gpu.joins]}")
            continue
        join = joins[0]
        key = (join.peer, join.iteration_id)
        if key in claimed:
            check.failures.append(f"{name}: GPU join {key} already claimed by {claimed[key]}")
            continue
        claimed[key] = name
        peer_of[join.peer] = record.engine
        check.num_cpu_matched += 1
        attention_by_step[gpu.step_id] += record.attention_ns
        cpu_runqueue_by_step[gpu.step_id] += record.runqueue_delay_ns
        check.join_wait_s.append(max(0, gpu.start_ns - record.start_ns) / 1e9)
        check.gpu_step_s.append(gpu.duration_ns / 1e9)
        check.tail_s.append(max(0, record.end_ns - gpu.end_ns) / 1e9)
    check.num_unclaimed_joins = sum((j.peer, j.iteration_id) not in claimed
                                    for r in gpu_steps.values() for j in r.joins)
    for step_id, attention_ns in attention_by_step.items():
        gpu = gpu_steps[step_id]
        if gpu.num_own_rows > 0:  # a step of remote rows alone has nothing to overlap with
            check.gpu_wait_ns += gpu.gpu_wait_ns
            check.cpu_attention_ns += attention_ns
            check.gpu_step_ns += gpu.duration_ns
            if gpu.cover_ns:
                uncovered = max(0, attention_ns - gpu.cover_ns)
                check.cover_ns += gpu.cover_ns
                check.uncovered_ns += min(uncovered, gpu.gpu_wait_ns)
                check.transport_ns += max(0, gpu.gpu_wait_ns - uncovered)
            for name in (*MARK_FIELDS, "num_marked_layers", "num_wait_sleeps", "num_long_waits", "long_wait_ns"):
                check.marks[name] += getattr(gpu, name)
            check.marks["gpu_runqueue_ns"] += gpu.runqueue_delay_ns
            check.marks["cpu_runqueue_ns"] += cpu_runqueue_by_step[step_id]
            totals = check.wait_and_attention_ns_by_how.setdefault(gpu.how or "unsaid", [0, 0])
            totals[0] += gpu.gpu_wait_ns
            totals[1] += attention_ns
    return check


def timeline_paths(directory: str, policy: str, clear: bool = False) -> dict[str, str]:
    """Where a bench run's engines write their timelines: DIR/<policy>_<engine>.jsonl. clear: remove
    older files first (an engine appends, and an older run's records would repeat step ids)."""
    paths = {engine: Path(directory) / f"{policy}_{engine}.jsonl" for engine in ("gpu", "cpu")}
    if clear:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for path in paths.values():
            path.unlink(missing_ok=True)
    return {engine: str(path) for engine, path in paths.items()}


def check_files(paths: dict[str, str], policy: str) -> dict:
    """The summary of `check_timelines` over a bench run's files, with the report's lines; a file
    missing or malformed is a failed check that says so (the bench's other results stand)."""
    try:
        check = check_timelines(read_timeline(paths["gpu"]), read_timeline(paths["cpu"]), policy)
    except (OSError, DualPaceError) as exc:
        return {"policy": policy, "passed": False, "files": paths, "report": f"step timelines unreadable: {exc}"}
    return {**check.summary(), "files": paths, "report": format_report(check)}


def format_report(check: TimelineCheck) -> str:
    s = check.summary()

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    share = "not measured (no CPU attention times in steps with own rows)" if s["gpu_wait_share"] is None \
        else f"{100 * s['gpu_wait_share']:.2f}% (target < {100 * check.max_wait_share:g}%)"
    lines = [
        f"policy {check.policy}: {s['num_gpu_steps']} GPU steps, {s['num_gpu_steps_with_joins']} with joins; "
        f"CPU decode iterations by mode {s['cpu_decode_iterations_by_mode']}",
        f"[{verdict(check.advance_only_inside_gpu)}] CPU iterations inside GPU steps: "
        f"{s['num_cpu_matched']} of {s['num_cpu_checked']} found among the GPU's joins; "
        f"{s['num_unclaimed_joins']} GPU joins unclaimed",
        *(f"    {line}" for line in s["failures"]),
        f"[{verdict(check.gpu_not_idle)}] GPU wait / CPU attention: {s['gpu_wait_ms']} / "
        f"{s['cpu_attention_ms']} ms = {share}",
        *(f"    {how}: {'-' if value is None else f'{100 * value:.2f}%'}" for how, value in s["gpu_wait_share_by_how"].items()),
        *([f"    the wait is {100 * s['gpu_wait_share_of_steps']:.2f}% of those GPU steps' {s['gpu_step_ms']} ms"]
          if s["gpu_wait_share_of_steps"] is not None else []),
        *([f"    of the wait: {s['gpu_wait_uncovered_ms']} ms attention longer than the GPU's own overlapping "
           f"work ({s['cover_ms']} ms), {s['gpu_wait_transport_ms']} ms transport and scheduling"]
          if s["cover_ms"] else []),
    ]
    marks = s["layer_marks"]
    if marks["num_layers"]:
        lines.append(f"    per layer ({marks['num_layers']} stamped), mean: q/k/v -> CPU {marks['down_hop_us']} us, "
                     f"CPU {marks['cpu_layer_us']} us, GPU wait before the answer {marks['wait_before_answer_us']} us, "
                     f"answer -> GPU {marks['up_hop_us']} us; GPU waits that slept {100 * marks['sleeps_per_layer']:.0f}%")
        lines.append(f"    layer waits >= 1 ms: {marks['num_long_waits']}, {marks['long_wait_ms']} ms of the wait; "
                     f"runnable without a core: GPU step threads {marks['gpu_runqueue_ms']} ms, "
                     f"CPU iterations {marks['cpu_runqueue_ms']} ms")
    for key, label in (("join_wait", "CPU iteration start -> GPU step start"), ("gpu_step", "GPU step"),
                       ("tail_after_gpu_step", "GPU step end -> CPU iteration end")):
        d = s[key]
        if d["count"]:
            lines.append(f"    {label}: p50 {d['p50_ms']} ms, p99 {d['p99_ms']} ms, max {d['max_ms']} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", required=True, metavar="JSONL", help="gpu_service's --step-timeline file")
    parser.add_argument("--cpu", required=True, action="append", metavar="JSONL",
                        help="a cpu_service's --step-timeline file (repeat for each CPU engine)")
    parser.add_argument("--policy", default=Policy.GATED.value, choices=CPU_SERVICE_POLICY_NAMES)
    parser.add_argument("--max-wait-share", type=float, default=DEFAULT_MAX_WAIT_SHARE)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary here")
    args = parser.parse_args(argv)
    try:
        gpu_records = read_timeline(args.gpu)
        cpu_records = [record for path in args.cpu for record in read_timeline(path)]
    except (OSError, DualPaceError) as exc:
        print(f"cooperative_timeline: error: {exc}", file=sys.stderr)
        return 2
    check = check_timelines(gpu_records, cpu_records, args.policy, args.max_wait_share)
    print(format_report(check))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(check.summary(), file, indent=2)
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
