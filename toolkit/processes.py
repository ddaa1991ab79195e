"""Start DualPace daemons as real subprocesses on 127.0.0.1 ephemeral ports (system tests, benchmarks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dualpace.serve.readiness import LISTENING, wait_serving

START_TIMEOUT_S = 120.0
ENGINE_MODULES = ("gpu_service", "cpu_service")
# The engines started here migrate to each other at ports picked at bind, all on 127.0.0.1.
LOOPBACK_PEERS = ("--peer", "127.0.0.1:*")


@dataclass
class Daemon:
    process: subprocess.Popen
    address: str
    output: deque = field(default_factory=lambda: deque(maxlen=400))

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return "".join(self.output)


def start_daemon(module: str, *args: str, env: dict[str, str] | None = None, cpu_cores: str | None = None,
                 listen: str = "127.0.0.1:0", step_timeline: str | None = None,
                 credentials=None) -> Daemon:
    """`python -m module args... --listen LISTEN` (an ephemeral port by default, or a fixed address to
    restart an engine where it was); waits for the address line and health SERVING.
    cpu_cores (e.g. "0" or "0,1") pins the process with taskset. An engine whose args name no
    --peer gets `--peer 127.0.0.1:*` (it may migrate to the other engines started here; give
    --peer to test the refusal, or for engines on unix: sockets). step_timeline: an engine writes
    a JSON line per step there (--step-timeline; bench/cooperative_timeline.py reads it).
    credentials: grpc channel credentials for the health check of a daemon that serves TLS."""
    pin = ["taskset", "-c", cpu_cores] if cpu_cores is not None else []
    peers = LOOPBACK_PEERS if module in ENGINE_MODULES and "--peer" not in args else ()
    if step_timeline is not None and module not in ENGINE_MODULES:
        raise ValueError(f"{module} keeps no step timeline (only {', '.join(ENGINE_MODULES)} do)")
    timeline = ("--step-timeline", step_timeline) if step_timeline is not None else ()
    process = subprocess.Popen(
        [*pin, sys.executable, "-m", module, *args, *peers, *timeline, "--listen", listen],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )
    output: deque = deque(maxlen=400)
    found = threading.Event()
    address: list[str] = []

    def pump() -> None:
        for line in process.stdout:
            output.append(line)
            match = LISTENING.search(line)
            if match and not address:
                address.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(START_TIMEOUT_S) or not address:
        process.kill()
        raise RuntimeError(f"{module} did not start:\n{''.join(output)}")
    daemon = Daemon(process, address[0], output)
    wait_serving(daemon.address, credentials=credentials)
    return daemon


def start_all(**starters: Callable[[], Daemon]) -> dict[str, Daemon]:
    """Start daemons in parallel (a start mostly waits on its process: imports, model load,
    warm-up): name -> daemon. If one fails the others are stopped, and every failure is raised."""
    with ThreadPoolExecutor(len(starters)) as pool:
        futures = {name: pool.submit(start) for name, start in starters.items()}
    started, errors = {}, []
    for name, future in futures.items():
        try:
            started[name] = future.result()
        except Exception as exc:  # noqa: BLE001 - report every failed start at once
            errors.append(f"{name}: {exc}")
    if errors:
        stop_all(started.values())
        raise RuntimeError("daemons did not start:\n" + "\n".join(errors))
    return started


def stop_all(daemons: Iterable[Daemon], timeout_s: float = 30.0) -> dict[int, int | None]:
    """SIGTERM every live daemon at once, then wait for each (SIGKILL past timeout_s);
    pid -> exit status."""
    daemons = list(daemons)
    for daemon in daemons:
        if daemon.process.poll() is None:
            daemon.process.send_signal(signal.SIGTERM)
    codes = {}
    for daemon in daemons:
        try:
            daemon.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            daemon.kill()
        codes[daemon.process.pid] = daemon.process.returncode
    return codes


UP_READY = re.compile(r"dualpace up: ready; router on (\S+)")


def start_up(*flags: str, env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S) -> Daemon:
    """`python -m dualpace up flags...`; waits for its ready line. The Daemon's address is the
    router's; SIGTERM (Daemon.stop) stops all three processes."""
    process = subprocess.Popen([sys.executable, "-m", "dualpace", "up", *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    output: deque = deque(maxlen=400)
    found = threading.Event()
    router: list[str] = []

    def pump() -> None:
        for line in process.stdout:
            output.append(line)
            if not router and (match := UP_READY.search(line)):
                router.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(timeout_s) or not router:
        process.kill()
        process.wait()
        raise RuntimeError("dualpace up never became ready:\n" + "".join(output))
    return Daemon(process, router[0], output)
