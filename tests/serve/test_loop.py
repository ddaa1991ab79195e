"""serve_forever: uvloop, and SIGTERM/SIGINT as a clean stop; a real daemon process end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dualpace.serve import install_uvloop, serve_forever

REPO_ROOT = Path(__file__).resolve().parents[2]

# A minimal daemon: start_server + print_listening + serve_forever, as the real ones do.
DAEMON_SCRIPT = """
import asyncio
from dualpace.serve import print_listening, serve_forever, start_server
from dualpace.wire.v1 import engine_pb2_grpc

async def run(stop: asyncio.Event) -> int:
    running = await start_server(
        "127.0.0.1:0",
        lambda server: engine_pb2_grpc.add_EngineServicer_to_server(engine_pb2_grpc.EngineServicer(), server),
        ["dualpace.v1.Engine"],
    )
    print_listening("probe", running.address)
    await stop.wait()
    await running.stop(grace_s=1.0)
    print("probe stopped cleanly", flush=True)
    return 3

raise SystemExit(serve_forever(run))
"""


@pytest.fixture
def restore_loop_policy() -> Iterator[None]:
    yield
    asyncio.set_event_loop_policy(None)


def test_install_uvloop(restore_loop_policy: None) -> None:
    assert install_uvloop() is True
    assert type(asyncio.get_event_loop_policy()).__module__.startswith("uvloop")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_sets_stop_and_returns_exit_code(restore_loop_policy: None, signum: signal.Signals) -> None:
    async def main(stop: asyncio.Event) -> int:
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signum)
        await asyncio.wait_for(stop.wait(), timeout=5)
        return 7

    assert serve_forever(main) == 7
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers removed again


def test_daemon_process_prints_address_serves_and_stops_on_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", DAEMON_SCRIPT], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline().strip()
        assert line.startswith("probe listening on 127.0.0.1:"), process.stderr.read()
        address = line.removeprefix("probe listening on ")
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="dualpace.v1.Engine"), timeout=5
            )
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 3, stderr
    assert stdout.strip() == "probe stopped cleanly"
