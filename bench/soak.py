"""Soak with chaos: gpu_service, cpu_service and the router as real processes on 127.0.0.1, an
open-loop request stream for a bounded time and count, and faults mixed in:

- about 10% of the requests are cancelled by the client after a random number of tokens,
- about 5% are invalid (each breaks one field) and must be answered with INVALID_ARGUMENT,
- migrations: gpu_service gets a small KV pool, so the router hands requests off to
  cpu_service and its planner moves them (counted from the router's metrics and ListPlacements),
- one engine restart in the middle: the engine (cpu by default) is SIGKILLed and started again
  on the same address; the router must reconnect and requests must complete after it.

At the end, once every request has ended: each engine's KV pool must be whole again
(GetLoad: kv_blocks_used == 0, i.e. free == total), each long-lived daemon's RSS
(/proc/PID/status VmRSS) must have grown by less than --max-rss-growth-pct between the end of
the warm-up and the end (the restarted engine: from warm-up after its restart), and every
request must be classified: completed (exact token count, finish LENGTH), failed with an
explicit error (by code), cancelled by the client, invalid and rejected, or lost (no terminal
event, or hung past its deadline) — lost must be 0. Exit status 0 when every check holds.

    python -m bench.soak --duration-s 180                  # tiny synthetic model (default)
    python -m bench.soak --duration-s 600 --json           # the 10-minute soak, one JSON object on stdout
    python -m bench.soak --model smollm2-135m --duration-s 120 --rate 0.5 --block-size 16 --gpu-kv-blocks 16 \\
        --input-len 16:64 --output-len 16:64 --warmup-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.soak_client import (
    CANCELLED,
    COMPLETED,
    INVALID_REJECTED,
    LOST,
    WRONG,
    RequestOutcome,
    Tally,
    plan_requests,
    run_chaos_load,
)
from bench.soak_args import TINY, parse_soak_args
from bench.soak_chaos import Chaos
from toolkit.daemon_metrics import DaemonSlot, metrics_address, router_migrations_from_metrics, rss_kib
from bench.soak_report import report, summary_table
from dualpace.wire.v1 import router_pb2, router_pb2_grpc
from toolkit.engine_client import EngineClient
from toolkit.processes import start_daemon
from toolkit.workload import build_requests, parse_length_spec



def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Soak:
    args: argparse.Namespace
    model: str
    slots: dict[str, DaemonSlot] = field(default_factory=dict)
    outcomes: list[RequestOutcome] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    migrations_seen: dict[tuple, str] = field(default_factory=dict)  # (id, from, to, ts) -> outcome
    migration_failures: dict[tuple, str] = field(default_factory=dict)  # key -> detail
    placements_errors: Counter = field(default_factory=Counter)
    load_started: float | None = None  # time.monotonic()
    restart_done: threading.Event = field(default_factory=threading.Event)
    restart_serving_s: float | None = None  # soak clock: when the restarted engine was back
    router_reconnected_s: float | None = None  # soak clock: when the router saw it healthy again
    chaos: object = None  # bench.soak_chaos.Chaos, unless --no-chaos-extra

    def clock(self) -> float:
        return 0.0 if self.load_started is None else time.monotonic() - self.load_started

    # -- daemons ---------------------------------------------------------------------------------

    def engine_args(self, role: str) -> list[str]:
        a = self.args
        common = ["--model", self.model, "--dtype", a.dtype, "--threads", str(a.threads),
                  "--block-size", str(a.block_size), "--name", role, "--orphan-timeout-s", str(a.orphan_timeout_s)]
        if role == "gpu":
            return [*common, "--kv-blocks", str(a.gpu_kv_blocks)]
        return [*common, "--kv-blocks", str(a.cpu_kv_blocks), "--gpu-service", self.slots["gpu"].daemon.address,
                "--assist", a.assist]

    def engine_env(self) -> dict[str, str]:
        delay = self.args.step_delay_ms
        return {"DUALPACE_FAULT_STEP_DELAY_MS": str(delay)} if delay else {}

    def start(self) -> None:
        log(f"soak: starting gpu_service, cpu_service and the router ({self.model})")
        gpu = start_daemon("gpu_service", *self.engine_args("gpu"), env=self.engine_env())
        self.slots["gpu"] = DaemonSlot("gpu", gpu)
        cpu = start_daemon("cpu_service", *self.engine_args("cpu"), env=self.engine_env())
        self.slots["cpu"] = DaemonSlot("cpu", cpu)
        router_flags = ["serve", "--gpu", gpu.address, "--cpu", cpu.address, "--model", self.model,
                        "--metrics-port", "0"]
        self.slots["router"] = DaemonSlot("router", start_daemon("router", *router_flags))
        log("soak: " + ", ".join(f"{r} {s.daemon.address} (pid {s.daemon.process.pid})"
                                   for r, s in self.slots.items()))

    def stop(self) -> dict[str, int | None]:
        codes = {}
        for role in ("router", "cpu", "gpu"):
            if role in self.slots:
                codes[role] = self.slots[role].daemon.stop()
        return codes

    def restart_engine(self, role: str) -> None:
        """SIGKILL the engine, start it again on the same address, wait until the router sees it."""
        slot = self.slots[role]
        address = slot.daemon.address
        # Kill it while it holds requests (waiting a little for some), so the relay's failover runs too.
        wait_until = time.monotonic() + self.args.restart_wait_busy_s
        while True:
            placed = self.poll_placements_sync()
            on_victim = None if placed is None else sum(1 for r in placed.requests if r.engine == role)
            if on_victim or time.monotonic() >= wait_until:
                break
            time.sleep(0.05)
        killed_at = self.clock()
        log(f"soak: t={killed_at:.1f}s SIGKILL {role} (pid {slot.daemon.process.pid}) at {address}, "
            f"holding {on_victim} requests")
        slot.daemon.process.send_signal(signal.SIGKILL)
        slot.daemon.process.wait(30)
        time.sleep(self.args.restart_down_s)
        module = "gpu_service" if role == "gpu" else "cpu_service"
        fault = {"kind": "sigkill_restart", "engine": role, "address": address, "killed_at_s": round(killed_at, 1),
                 "requests_on_engine_when_killed": on_victim}
        self.faults.append(fault)
        try:
            slot.daemon = start_daemon(module, *self.engine_args(role), env=self.engine_env(), listen=address)
        except RuntimeError as exc:
            fault["restart_error"] = str(exc)[-500:]
            log(f"soak: {role} did not restart: {str(exc)[-300:]}")
            self.restart_done.set()
            return
        self.restart_serving_s = self.clock()
        slot.restarted_at_s = self.restart_serving_s
        slot.rss_start_kib = None
        fault["serving_again_at_s"] = round(self.restart_serving_s, 1)
        log(f"soak: t={self.restart_serving_s:.1f}s {role} serving again (pid {slot.daemon.process.pid})")
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(self.slots["router"].daemon.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while time.monotonic() < deadline:
                try:
                    placed = stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=5)
                    if any(e.name == role and e.healthy for e in placed.engines):
                        self.router_reconnected_s = self.clock()
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        if self.router_reconnected_s is None:
            fault["router_reconnected_at_s"] = None
            log(f"soak: the router did not see {role} healthy again within 60 s")
        else:
            fault["router_reconnected_at_s"] = round(self.router_reconnected_s, 1)
            log(f"soak: t={self.router_reconnected_s:.1f}s the router sees {role} healthy again")
        self.restart_done.set()

    # -- observation -----------------------------------------------------------------------------

    def sample_rss(self, which: str) -> None:
        for slot in self.slots.values():
            value = rss_kib(slot.daemon.process.pid)
            if which == "start":
                slot.rss_start_kib = value
            else:
                slot.rss_end_kib = value

    def poll_placements(self, stub) -> router_pb2.Placements | None:
        try:
            placed = stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=5)
        except grpc.RpcError as exc:
            self.placements_errors[exc.code().name] += 1
            return None
        for m in placed.migrations:
            key = (m.request_id, m.from_engine, m.to_engine, m.timestamp_unix_ms)
            self.migrations_seen[key] = router_pb2.MigrationOutcome.Name(m.outcome).removeprefix("MIGRATION_OUTCOME_")
            if m.outcome == router_pb2.MIGRATION_OUTCOME_FAILED:
                self.migration_failures[key] = m.detail
        return placed

    async def observe(self, stop: asyncio.Event) -> None:
        """Progress lines, ListPlacements polling (migrations), RSS after warm-up, the restart."""
        a = self.args
        last_line = 0.0
        restart_task = None
        warmed_up = False
        try:
            while not stop.is_set():
                now = self.clock()
                placed = await asyncio.to_thread(self.poll_placements_sync)
                if not warmed_up and now >= a.warmup_s:
                    warmed_up = True
                    for slot in self.slots.values():
                        if slot.restarted_at_s is None:
                            slot.rss_start_kib = rss_kib(slot.daemon.process.pid)
                    log(f"soak: t={now:.1f}s warm-up over; RSS baseline " + ", ".join(
                        f"{r} {(s.rss_start_kib or 0) / 1024:.0f} MiB" for r, s in self.slots.items()))
                for slot in self.slots.values():
                    if (slot.restarted_at_s is not None and slot.rss_start_kib is None
                            and now >= slot.restarted_at_s + a.warmup_s):
                        slot.rss_start_kib = rss_kib(slot.daemon.process.pid)
                        log(f"soak: t={now:.1f}s restarted {slot.role} warmed up; RSS baseline "
                            f"{(slot.rss_start_kib or 0) / 1024:.0f} MiB")
                if a.restart != "none" and restart_task is None and now >= a.restart_at_s:
                    restart_task = asyncio.create_task(asyncio.to_thread(self.restart_engine, a.restart))
                if now - last_line >= a.progress_s:
                    last_line = now
                    for slot in self.slots.values():
                        value = rss_kib(slot.daemon.process.pid)
                        if value is not None:
                            slot.rss_series.append([round(now, 1), round(value / 1024, 1)])
                    log(self.progress_line(now, placed))
                await asyncio.sleep(1.0)
        finally:
            if restart_task is not None:
                await restart_task

    def poll_placements_sync(self):
        with grpc.insecure_channel(self.slots["router"].daemon.address) as channel:
            return self.poll_placements(router_pb2_grpc.RouterStub(channel))

    def progress_line(self, now: float, placed) -> str:
        tally = Tally.of(self.outcomes)
        s = tally.by_status
        engines = ""
        if placed is not None:
            engines = " | " + ", ".join(
                f"{e.name}{'' if e.healthy else '(down)'} kv {e.kv_blocks_used}/{e.kv_blocks_total} "
                f"run {e.num_running} wait {e.num_waiting}" for e in placed.engines)
        committed = sum(1 for o in self.migrations_seen.values() if o == "COMMITTED")
        rss = " ".join(f"{s.role} {s.rss_series[-1][1]:.0f}" for s in self.slots.values() if s.rss_series)
        return (f"soak: t={now:5.1f}s sent {tally.sent} in flight {tally.sent - tally.done} | "
                f"completed {s[COMPLETED]} cancelled {s[CANCELLED]} invalid {s[INVALID_REJECTED]} "
                f"failed {dict(tally.failed_by_code) or 0} lost {s[LOST]} wrong {s[WRONG]} | "
                f"migrations {committed}{engines} | RSS MiB {rss}")

    def final_loads(self, timeout_s: float) -> dict[str, dict]:
        """Each engine's load once idle (bounded wait): blocks still used are leaked."""
        loads = {}
        for role in ("gpu", "cpu"):
            daemon = self.slots[role].daemon
            deadline = time.monotonic() + timeout_s
            last = None
            client = EngineClient(daemon.address)
            try:
                while True:
                    try:
                        last = client.load(timeout_s=5)
                    except grpc.RpcError as exc:
                        loads[role] = {"error": exc.code().name}
                        break
                    if (last.kv_blocks_used == 0 and last.num_running == 0 and last.num_waiting == 0) \
                            or time.monotonic() > deadline:
                        loads[role] = {"kv_blocks_total": last.kv_blocks_total, "kv_blocks_used": last.kv_blocks_used,
                                       "num_running": last.num_running, "num_waiting": last.num_waiting}
                        break
                    time.sleep(0.2)
            finally:
                client.close()
        return loads


async def drive(soak: Soak, requests) -> float:
    a = soak.args
    stop = asyncio.Event()
    started = asyncio.Event()
    soak.load_started = time.monotonic()
    load = asyncio.create_task(run_chaos_load(
        soak.slots["router"].daemon.address, requests, seed=a.seed, duration_s=a.duration_s,
        deadline_s=a.request_deadline_s, outcomes=soak.outcomes, started=started))
    await started.wait()
    soak.load_started = time.monotonic()
    observer = asyncio.create_task(soak.observe(stop))
    chaos_stop = threading.Event()
    chaos = asyncio.create_task(asyncio.to_thread(soak.chaos.run, chaos_stop)) if soak.chaos else None
    try:
        window_s = await load
    finally:
        stop.set()
        chaos_stop.set()
        await observer
        if chaos is not None:
            await chaos
    return window_s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parse_soak_args(argv, __doc__)


def run_soak(args: argparse.Namespace) -> dict:
    """Start the daemons, run the chaos load, check the engines; returns the result object."""
    ins, outs = parse_length_spec(args.input_len, "--input-len"), parse_length_spec(args.output_len, "--output-len")
    specs = build_requests(args.max_requests, args.rate, args.burstiness, args.seed, args.vocab_size, ins, outs)
    requests = plan_requests(specs, args.cancel_frac, args.invalid_frac, args.seed)
    started = time.monotonic()
    tmp = None
    model = args.model
    if model == TINY:
        from dualpace.model.synth import write_synthetic_checkpoint
        tmp = tempfile.mkdtemp(prefix="dualpace-soak-")
        model = str(write_synthetic_checkpoint("tiny-llama", Path(tmp) / "tiny-llama", seed=0))
    soak = Soak(args, model)
    soak.chaos = None if args.no_chaos_extra else Chaos(soak)
    try:
        soak.start()
        router_metrics = metrics_address(soak.slots["router"].daemon)
        log(f"soak: {args.duration_s:g} s of load at {args.rate:g} req/s (at most {args.max_requests} requests), "
            f"cancel {args.cancel_frac:.0%}, invalid {args.invalid_frac:.0%}, restart {args.restart} at "
            f"{args.restart_at_s:g} s, RSS baseline at {args.warmup_s:g} s, step delay {args.step_delay_ms} ms")
        window_s = asyncio.run(drive(soak, requests))
        log(f"soak: t={soak.clock():.1f}s every request ended; checking the engines")
        soak.poll_placements_sync()
        loads = soak.final_loads(timeout_s=30.0)
        soak.sample_rss("end")
        if soak.chaos is not None:
            soak.chaos.sample("end")
            soak.chaos.verify(args.orphan_timeout_s)
        migrations_metric = router_migrations_from_metrics(router_metrics)
    finally:
        exit_codes = soak.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result = report(soak, window_s, time.monotonic() - started, loads, exit_codes, migrations_metric)
    if soak.chaos is not None:
        result["chaos"] = soak.chaos.summary()
        result["problems"] += soak.chaos.problems
        result["ok"] = not result["problems"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_soak(args)
    table = summary_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        log(table)
        print(json.dumps(result))
    else:
        print(table)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
