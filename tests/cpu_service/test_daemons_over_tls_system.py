"""The three daemons on TCP loopback, every one serving mutual TLS with one deployment CA
(real processes): cpu_service's Dense Assist stream to gpu_service and the router's calls to
both engines (`--engine-tls on`) go over TLS with the caller's certificate, as the engines'
own KV migrations do. Before, both were plaintext channels, which a TLS engine refuses: an
assisted CPU engine ran every iteration locally and the router never saw an engine."""

from __future__ import annotations

import shutil

import grpc
import pytest

from dualpace.sampling import SamplingParams
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import common_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.cpu_service.conftest import ENGINE_FLAGS, solo
from tests.serve.test_security import _self_signed
from toolkit.processes import start_daemon

HANG_GUARD_S = 120.0
PROMPT = [(i * 29 + 7) % 300 + 1 for i in range(12)]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_assist_and_router_calls_go_over_mutual_tls(tmp_path, model_folder, loaded):
    cert, key = _self_signed(tmp_path, "localhost")  # one certificate for every daemon, its own CA
    tls_flags = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(cert))
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes(), private_key=key.read_bytes(),
                                               certificate_chain=cert.read_bytes())
    daemons = []
    try:
        gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                           *tls_flags, credentials=credentials)
        daemons.append(gpu)
        cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                           "--assist", "always", "--gpu-service", gpu.address, "--assist-transport", "tcp",
                           *tls_flags, credentials=credentials)
        daemons.append(cpu)
        router = start_daemon("router", "serve", "--gpu", gpu.address, "--cpu", cpu.address, "--model", model_folder,
                              "--engine-tls", "on", *tls_flags, credentials=credentials)
        daemons.append(router)
        expected = solo(loaded, PROMPT, PARAMS)

        with grpc.secure_channel(cpu.address, credentials) as channel:  # assisted on the CPU engine
            request = new_request_to_pb("assisted", PROMPT, PARAMS)
            tokens = [t for r in engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=HANG_GUARD_S)
                      for t in r.token_ids]
        assert tokens == expected
        assert "iterations now run assisted" in cpu.log() and "redoing it locally" not in cpu.log(), cpu.log()
        assert "dense assist through a TCP data socket" in cpu.log(), cpu.log()  # over TLS, as its gRPC calls

        with grpc.secure_channel(router.address, credentials) as channel:  # through the router
            message = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(token_ids=PROMPT),
                                                 sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True))
            stub = router_pb2_grpc.RouterStub(channel)
            tokens = [t for r in stub.Generate(message, timeout=HANG_GUARD_S) for t in r.token_ids]
            engines = stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10).engines
        assert tokens == expected
        assert sorted(e.name for e in engines if e.healthy) == ["cpu", "gpu"]
    finally:
        codes = [(daemon.stop(), daemon) for daemon in reversed(daemons)]
        for code, daemon in codes:
            assert code == 0, daemon.log()


def test_engine_tls_needs_the_router_certificate(model_folder):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "router", "serve", "--gpu", "127.0.0.1:9", "--model", model_folder,
                           "--engine-tls", "on"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--engine-tls: on needs --tls-cert and --tls-key" in done.stderr
