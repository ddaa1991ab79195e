"""`dualpace up` supervises its daemons like systemd's Restart=on-failure.

One `dualpace up` on the tiny model (every engine step slowed by a test-only fault so that
requests overlap; the engines on Unix sockets, as `up` starts them). With concurrent requests
in flight cpu_service is SIGKILLed, then, with a new batch in flight, gpu_service. Criteria each
time: every request completes greedy-identical
to its solo run (the router continues the victim's requests on the survivor), `up` logs the
exit and the restart and keeps the others running, the engine comes back on the same address
with a new pid, the router's placement view shows it healthy again, and its KV accounting
starts clean (GetLoad: 0 blocks used, no request). Ctrl-C-style SIGTERM still stops all three
with exit 0. Every wait is a hang guard, never a timing criterion.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from dualpace.wire.v1 import router_pb2
from tests.reliability.conftest import (
    EngineProbe,
    RouterStream,
    assert_exact,
    cancelled_if_unfinished,
    prompt_for,
    router_stub,
)
from tests.helpers import wait_for
from tests.router.conftest import alive

READY = re.compile(r"dualpace up: ready; router on (\S+)")
CHILD = re.compile(r"dualpace up: (\S+) on (\S+) \(pid (\d+)\)")
HANG_GUARD_S = 120.0
NUM_REQUESTS = 12
MAX_TOKENS = 80
TOKENS_BEFORE_KILL = 3


class RunningUp:
    """A `dualpace up` process whose output is read on a thread: children's pids and addresses."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        self.addresses: dict[str, str] = {}
        self.router = ""
        self.changed = threading.Condition()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line)
                if match := CHILD.search(line):
                    self.addresses[match.group(1)] = match.group(2)
                    self.pids[match.group(1)] = int(match.group(3))
                if match := READY.search(line):
                    self.router = match.group(1)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_until(self, condition, timeout_s: float = HANG_GUARD_S) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: condition() or self.process.poll() is not None, timeout_s) \
                and condition()

    def log(self) -> str:
        """The last part of the output, for failure messages."""
        return "".join(self.lines)[-6000:]

    def up_lines(self) -> str:
        """Every line `up` itself wrote (not the daemons' relayed output)."""
        return "".join(line for line in self.lines if line.startswith("dualpace up:"))


@contextmanager
def running_up(tiny_folder: str, *flags: str) -> Iterator[RunningUp]:
    """`dualpace up` on the tiny model (steps slowed, no Dense Assist) with `flags`, once ready;
    stopped with SIGTERM afterwards."""
    env = {**os.environ, "DUALPACE_FAULT_STEP_DELAY_MS": "10"}
    running = RunningUp([sys.executable, "-m", "dualpace", "up", "--model", tiny_folder, "--dtype", "fp32",
                         "--threads-per-engine", "1", "--assist", "never", *flags], env)
    try:
        if not running.wait_until(lambda: bool(running.router)):
            pytest.fail(f"dualpace up never became ready:\n{running.log()}")
        yield running
    finally:
        if running.process.poll() is None:
            running.process.send_signal(signal.SIGTERM)
            try:
                running.process.wait(60)
            except subprocess.TimeoutExpired:
                running.process.kill()


@pytest.fixture(scope="module")
def up(tiny_folder):
    with running_up(tiny_folder, "--gpu-kv-blocks", "40", "--cpu-kv-blocks", "1024", "--max-restarts", "3") as running:
        yield running


def placements(stub) -> router_pb2.ListPlacementsResponse:
    return stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10)


@pytest.mark.parametrize("victim", ["cpu_service", "gpu_service"])
def test_killed_engine_is_restarted_and_requests_complete_exactly(up, victim, reference):
    channel = grpc.insecure_channel(up.router)
    stub = router_stub(channel)
    old_pid, address = up.pids[victim], up.addresses[victim]
    others = {name: pid for name, pid in up.pids.items() if name != victim}
    prompts = {f"up-{victim}-{i}": prompt_for(i, 3 + i % 5) for i in range(NUM_REQUESTS)}
    streams = {rid: RouterStream.run(stub, rid, prompt, MAX_TOKENS, timeout_s=HANG_GUARD_S)
               for rid, prompt in prompts.items()}
    with cancelled_if_unfinished(streams.values()):
        for rid, stream in streams.items():
            assert stream.wait_tokens(TOKENS_BEFORE_KILL, HANG_GUARD_S), (rid, stream.error)
        name = "cpu" if victim == "cpu_service" else "gpu"
        on_victim = wait_for(lambda: {r.request_id for r in placements(stub).requests if r.engine == name},
                             bool, HANG_GUARD_S)
        assert on_victim, "no request was on the engine when it died"
        os.kill(old_pid, signal.SIGKILL)
        for rid, stream in streams.items():
            assert stream.wait(HANG_GUARD_S), rid
    assert_exact(streams, prompts, MAX_TOKENS, reference, up.log())

    assert up.wait_until(lambda: up.pids[victim] != old_pid), f"{victim} was not restarted:\n{up.log()}"
    log = up.up_lines()
    assert f"{victim} exited unexpectedly with status -9; restarting it on {address}" in log
    assert re.search(rf"{victim} on {re.escape(address)} \(pid {up.pids[victim]}\) restarted \(1 of 3", log)
    assert up.addresses[victim] == address
    assert {name: pid for name, pid in up.pids.items() if name != victim} == others  # the others kept running
    assert up.process.poll() is None

    engine_view = wait_for(lambda: {e.name: e for e in placements(stub).engines}[name],
                           lambda e: e.healthy, HANG_GUARD_S, interval_s=0.1)
    assert engine_view.healthy, engine_view
    probe = EngineProbe(address)
    load = probe.wait_idle(HANG_GUARD_S)
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    after = RouterStream.run(stub, f"after-{victim}", prompt_for(99), 8, timeout_s=HANG_GUARD_S)
    assert after.wait(HANG_GUARD_S) and after.error is None, after.error
    assert after.tokens == reference(prompt_for(99), 8)
    probe.close()
    channel.close()


def test_sigterm_still_stops_all_three(up):
    """Last in this module: after the restarts, SIGTERM stops every daemon and `up` exits 0."""
    pids = dict(up.pids)
    # The engines are on Unix sockets in a private folder (only this user reaches them); up removes it.
    sockets = {name: address for name, address in up.addresses.items() if name != "router"}
    assert all(address.startswith("unix:") for address in sockets.values()), sockets
    folder = os.path.dirname(sockets["gpu_service"].removeprefix("unix:"))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(HANG_GUARD_S) == 0, up.log()
    up.pump.join(10)
    assert "dualpace up: stopped" in up.log()
    assert not os.path.exists(folder)
    for pid in pids.values():
        assert not alive(pid), f"child {pid} outlived dualpace up"

