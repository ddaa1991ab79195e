"""sd_notify by hand: datagrams, the watchdog interval, the step loop's pings, gpu_service under a
fake NOTIFY_SOCKET (READY after warm-up, STATUS, WATCHDOG, pings stop while a step stalls,
STOPPING on SIGTERM), and `systemd-analyze verify` on the unit files."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dualpace.engine import loop as engine_loop
from dualpace.engine.loop import EngineLoop
from dualpace.engine.step_timeline import read_timeline
from dualpace.sampling import SamplingParams
from dualpace.serve.sd_notify import Notifier, socket_address, watchdog_interval_s
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2_grpc
from tests.helpers import until, wait_for
from toolkit.processes import start_daemon

REPO_ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = REPO_ROOT / "deploy" / "systemd"
WATCHDOG_USEC = 400_000  # pings every 0.2 s
STEP_DELAY_MS = 600


class FakeManager:
    """A bound AF_UNIX datagram socket standing in for systemd; records (time, lines) per datagram."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, list[str]]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append((time.monotonic(), data.decode().split("\n")))

    def snapshot(self) -> list[tuple[float, list[str]]]:
        with self._lock:
            return list(self.messages)

    def lines(self) -> list[str]:
        return [line for _, lines in self.snapshot() for line in lines]

    def watchdog_times(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [t for t, lines in self.snapshot() if "WATCHDOG=1" in lines and since <= t <= until]

    def wait_for(self, line: str, count: int = 1, timeout_s: float = 10.0) -> bool:
        """Whether `line` has come `count` times (waiting up to timeout_s)."""
        return wait_for(lambda: self.lines().count(line), lambda seen: seen >= count, timeout_s, 0.02) >= count

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def manager() -> Iterator[FakeManager]:
    directory = tempfile.mkdtemp(prefix="dp-notify-")  # short: AF_UNIX paths are limited to ~107 bytes
    fake = FakeManager(os.path.join(directory, "notify.sock"))
    try:
        yield fake
    finally:
        fake.close()
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------- the protocol


def test_datagrams_reach_the_socket(manager: FakeManager) -> None:
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": manager.path})
    assert notifier.enabled
    assert notifier.status("loading\nmodel")  # one line: a newline would start a new assignment
    assert notifier.ready("serving on 127.0.0.1:1")
    assert notifier.watchdog()
    assert notifier.stopping()
    notifier.close()
    assert manager.wait_for("STOPPING=1")
    assert [lines for _, lines in manager.snapshot()] == [
        ["STATUS=loading model"], ["READY=1", "STATUS=serving on 127.0.0.1:1"], ["WATCHDOG=1"], ["STOPPING=1"]]


def test_abstract_namespace() -> None:
    name = f"dualpace-test-{os.getpid()}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(b"\0" + name.encode())
    receiver.settimeout(5)
    try:
        assert Notifier.from_environ({"NOTIFY_SOCKET": "@" + name}).ready()
        assert receiver.recv(100) == b"READY=1"
    finally:
        receiver.close()


def test_unset_or_unsupported_socket_is_a_no_op(tmp_path: Path) -> None:
    assert not Notifier.from_environ({}).ready()
    assert socket_address("vsock:2:1234") is None and socket_address("") is None
    # A manager that went away: sending fails quietly.
    assert not Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).watchdog()


def test_watchdog_interval() -> None:
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}) == 1.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, pid=2) is None


class _IdleCore:
    """Just enough of an EngineCore for an idle EngineLoop."""

    class config:
        name = "idle"

    has_work = False


class _Clock:
    """The loop module's `time`: monotonic() and perf_counter() on a clock the test moves."""

    def __init__(self):
        self.now_s = 100.0

    def monotonic(self) -> float:
        return self.now_s

    def perf_counter(self) -> float:
        return self.now_s

    def __getattr__(self, name: str):
        return getattr(time, name)


async def test_step_loop_pings_while_idle(monkeypatch) -> None:
    """While idle the loop pings once per interval of its clock: not before the interval is up,
    however often it wakes (every interval of real time), and again once it is."""
    clock = _Clock()
    monkeypatch.setattr(engine_loop, "time", clock)
    loop = EngineLoop(_IdleCore())  # type: ignore[arg-type]
    pings, checks = [], [0]
    maybe_alive = loop._maybe_alive

    def counted_maybe_alive() -> None:
        checks[0] += 1
        maybe_alive()

    loop._maybe_alive = counted_maybe_alive
    loop.set_alive_callback(lambda: pings.append(clock.now_s), 0.05)
    task = asyncio.create_task(loop.run())
    await until(lambda: len(pings) == 1, "the idle loop's first ping")
    for step_s, expected_pings in ((0.049, 1), (0.001, 2), (0.03, 2), (0.03, 3)):
        clock.now_s += step_s
        seen = checks[0]
        await until(lambda: checks[0] >= seen + 2, "the idle loop checking its clock again")  # one whole check
        assert len(pings) == expected_pings, (clock.now_s, pings)
    loop.stop()
    await task
    loop.close()


# ---------------------------------------------------------------------- gpu_service under "systemd"


def test_gpu_service_notifies(manager: FakeManager, synth_checkpoint, tmp_path: Path) -> None:
    folder = str(synth_checkpoint("tiny-llama"))
    timeline = tmp_path / "steps.jsonl"
    daemon = start_daemon(
        "gpu_service", "--model", folder, "--dtype", "fp32", "--threads", "1", "--kv-blocks", "64",
        "--block-size", "8", step_timeline=str(timeline),
        env={"NOTIFY_SOCKET": manager.path, "WATCHDOG_USEC": str(WATCHDOG_USEC),
             "DUALPACE_FAULT_STEP_DELAY_MS": str(STEP_DELAY_MS)})
    try:
        assert manager.wait_for("READY=1"), daemon.log()
        lines = manager.lines()
        # Loading and warm-up come before READY=1; READY=1 names the bound address.
        assert lines.index("STATUS=loading model " + folder) < lines.index("STATUS=warming up") \
            < lines.index("READY=1")
        assert f"STATUS=serving on {daemon.address}" in lines

        # Idle: it keeps pinging.
        assert manager.wait_for("WATCHDOG=1", count=3), manager.snapshot()

        # A request of two steps, each stalled for STEP_DELAY_MS (three watchdog intervals) before it runs.
        with grpc.insecure_channel(daemon.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            started_ns = time.monotonic_ns()
            responses = list(stub.Generate(new_request_to_pb(
                "slow", [5, 9, 2, 11], SamplingParams(max_tokens=2, ignore_eos=True)), timeout=30))
        assert sum(len(r.token_ids) for r in responses) == 2
    finally:
        status = daemon.stop()
    assert status == 0, daemon.log()
    # No ping while a step runs: from the first stall's start to the second step's end (the
    # timeline's CLOCK_MONOTONIC, the manager's too) only the ping between the two steps, and at
    # most one idle ping from before sent in time but read after (pinging through the steps: ~6).
    steps = [r for r in read_timeline(timeline) if r.start_ns > started_ns and r.num_own_rows]
    assert len(steps) == 2, steps
    span = ((steps[0].start_ns - STEP_DELAY_MS * 1_000_000) / 1e9, steps[1].end_ns / 1e9)
    assert len(manager.watchdog_times(*span)) <= 2, (span, manager.snapshot())
    lines = manager.lines()
    assert "STOPPING=1" in lines
    assert lines.index("STOPPING=1") > lines.index("READY=1")


def test_router_notifies(manager: FakeManager, synth_checkpoint, tmp_path: Path) -> None:
    folder = str(synth_checkpoint("tiny-llama"))
    token = tmp_path / "token"
    token.write_text("router-test-token")
    gpu = start_daemon("gpu_service", "--model", folder, "--dtype", "fp32", "--threads", "1", "--kv-blocks", "32",
                       "--auth-token-file", str(token))
    try:
        router = start_daemon("router", "serve", "--gpu", gpu.address, "--model", folder, "--policy", "gpu-only",
                              "--auth-token-file", str(token),
                              env={"NOTIFY_SOCKET": manager.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
        try:
            assert manager.wait_for("READY=1"), router.log()
            assert f"STATUS=serving on {router.address}" in manager.lines()
            assert manager.wait_for("WATCHDOG=1", count=3), manager.snapshot()
            # READY came after the engine answered: with the token, the router sees it.
            assert "unreachable" not in router.log() and "not every engine answered" not in router.log()
        finally:
            assert router.stop() == 0, router.log()
        assert "STOPPING=1" in manager.lines()
    finally:
        assert gpu.stop() == 0, gpu.log()


# ---------------------------------------------------------------------- the unit files


def test_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    units = sorted(UNIT_DIR.glob("*.service"))
    assert [u.name for u in units] == ["dualpace-cpu.service", "dualpace-gpu.service", "dualpace-router.service"]
    # verify checks that ExecStart's binary exists: point it at this venv's entry points.
    bin_dir = Path(sys.executable).parent
    for unit in units:
        text = unit.read_text()
        assert "Type=notify" in text and "WatchdogSec=30" in text and "NotifyAccess=main" in text
        (tmp_path / unit.name).write_text(text.replace("/opt/dualpace/venv/bin/", f"{bin_dir}/"))
    if not all((bin_dir / name).exists() for name in ("dualpace-gpu", "dualpace-cpu", "dualpace-router")):
        pytest.skip("the dualpace entry points are not installed in this venv")
    result = subprocess.run([analyze, "verify", *[str(tmp_path / u.name) for u in units]],
                            capture_output=True, text=True, timeout=60, check=False)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "dualpace" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr
