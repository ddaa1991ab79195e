"""The daemons on Unix domain sockets (`--listen unix:PATH`).

gpu_service, cpu_service and the router each listen on a socket file in a private folder and
reach one another there. Criteria: every socket file is mode 0600 (the daemons' user alone);
a request through the router completes greedy-identical to its solo run, handed off from the
GPU engine to the CPU engine (a KV migration addressed by socket path); a second daemon on a
path a live server answers is refused (exit 2, naming the flag); an engine SIGKILLed leaves its
socket file behind and is started again on the same path (the stale file is replaced) and
serves.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import grpc
import pytest

from toolkit.processes import start_all, start_daemon
from tests.reliability.conftest import (
    ENGINE_FLAGS,
    EngineProbe,
    RouterStream,
    assert_clean_exit,
    prompt_for,
    router_stub,
)

HANG_GUARD_S = 120.0


@pytest.fixture
def folder():
    path = tempfile.mkdtemp(prefix="dp-sock-")  # short: a socket path has at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def socket_mode(path: str) -> int:
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode), path
    return stat.S_IMODE(mode)


def test_three_daemons_on_unix_sockets(tiny_folder, folder, reference):
    paths = {name: os.path.join(folder, f"{name}.sock") for name in ("gpu", "cpu", "router")}
    engines = start_all(  # both addresses are known before either starts
        gpu=lambda: start_daemon("gpu_service", "--model", tiny_folder, *ENGINE_FLAGS, "--name", "gpu-unix",
                                 "--kv-blocks", "64", "--block-size", "8", "--peer", f"unix:{paths['cpu']}",
                                 listen=f"unix:{paths['gpu']}"),
        cpu=lambda: start_daemon("cpu_service", "--model", tiny_folder, *ENGINE_FLAGS, "--name", "cpu-unix",
                                 "--kv-blocks", "256", "--block-size", "8", "--assist", "never",
                                 "--gpu-service", f"unix:{paths['gpu']}", "--peer", f"unix:{paths['gpu']}",
                                 listen=f"unix:{paths['cpu']}"))
    gpu, cpu = engines["gpu"], engines["cpu"]
    daemons = [gpu, cpu]
    try:
        router = start_daemon("router", "serve", "--gpu", gpu.address, "--cpu", cpu.address,
                              "--model", tiny_folder, "--no-migrate", listen=f"unix:{paths['router']}")
        daemons.append(router)
        assert {gpu.address, cpu.address, router.address} == {f"unix:{p}" for p in paths.values()}
        assert {name: socket_mode(path) for name, path in paths.items()} == {n: 0o600 for n in paths}

        channel = grpc.insecure_channel(router.address)
        stub = router_stub(channel)
        # Fill gpu_service so the next requests are placed on cpu_service, prefilled on the GPU and
        # handed off (a migration to the CPU engine's socket path).
        streams = [RouterStream.run(stub, f"unix-{i}", prompt_for(i), 120, timeout_s=HANG_GUARD_S) for i in range(6)]
        for stream in streams:
            assert stream.wait(HANG_GUARD_S) and stream.error is None, (stream.request_id, stream.error)
            assert stream.tokens == reference(prompt_for(int(stream.request_id.split("-")[1])), 120)
        assert any("cpu-unix" in stream.engines for stream in streams), [s.engines for s in streams]
        channel.close()

        # A second gpu_service on the live socket: refused, naming the flag.
        second = subprocess.run([sys.executable, "-m", "gpu_service", "--model", tiny_folder, *ENGINE_FLAGS,
                                 "--listen", f"unix:{paths['gpu']}"], capture_output=True, text=True,
                                timeout=HANG_GUARD_S)
        assert second.returncode == 2, second.stderr
        assert "--listen" in second.stderr and "a server is listening there" in second.stderr

        # SIGKILL leaves the socket file; a restart on the same path replaces it and serves.
        cpu.kill()
        assert os.path.exists(paths["cpu"])
        cpu = start_daemon("cpu_service", "--model", tiny_folder, *ENGINE_FLAGS, "--name", "cpu-unix",
                           "--kv-blocks", "256", "--block-size", "8", "--assist", "never",
                           listen=f"unix:{paths['cpu']}")
        daemons[1] = cpu
        assert socket_mode(paths["cpu"]) == 0o600
        probe = EngineProbe(cpu.address)
        probe.assert_serving_and_generates("unix-after-restart")
        probe.close()
    finally:
        assert_clean_exit(reversed(daemons))
