"""The host tier between engines that serve mutual TLS (real processes, TCP loopback): gpu_service
offers a finished request's cached blocks to cpu_service over TLS with its own certificate, as
its migrations do (dualpace.serve.security.peer_channel). Before, the offer went over a plaintext
channel and every one failed against a TLS engine."""

from __future__ import annotations

import shutil
import time

import grpc
import pytest

from dualpace.sampling import SamplingParams
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from tests.cpu_service.conftest import ENGINE_FLAGS
from tests.reliability.test_nan_logits import scrape
from tests.serve.test_security import _self_signed
from toolkit.processes import start_daemon

HANG_GUARD_S = 120.0  # only against a hang: the wait below ends on a condition


def offers(daemon, outcome: str) -> float:
    return scrape(daemon).get(("dualpace_host_tier_offers", (("engine", "gpu"), ("outcome", outcome))), 0.0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_host_tier_offers_go_over_mutual_tls(tmp_path, model_folder):
    cert, key = _self_signed(tmp_path, "localhost")  # one certificate for both engines, its own CA
    tls_flags = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(cert))
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes(), private_key=key.read_bytes(),
                                               certificate_chain=cert.read_bytes())
    cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64", "--name", "cpu",
                       "--assist", "never", *tls_flags, credentials=credentials)
    gpu = None
    try:
        gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "32", "--name", "gpu",
                           "--host-tier", cpu.address, "--metrics-port", "0", *tls_flags, credentials=credentials)
        prompt = [(i * 37 + 11) % 400 + 1 for i in range(30)]  # 3 full blocks of 8 once it has run
        with grpc.secure_channel(gpu.address, credentials) as channel:
            request = new_request_to_pb("turn-1", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
            tokens = [t for r in engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=HANG_GUARD_S)
                      for t in r.token_ids]
        assert len(tokens) == 4
        deadline = time.monotonic() + HANG_GUARD_S
        while offers(gpu, "accepted") + offers(gpu, "failed") < 1:
            assert time.monotonic() < deadline, gpu.log()
            time.sleep(0.05)
        assert (offers(gpu, "accepted"), offers(gpu, "failed")) == (1, 0), gpu.log()
        with grpc.secure_channel(cpu.address, credentials) as channel:
            load = engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        assert load.kv_blocks_cached >= 3 and load.kv_blocks_used == 0
    finally:
        codes = [(daemon.stop(), daemon) for daemon in (gpu, cpu) if daemon is not None]
        for code, daemon in codes:
            assert code == 0, daemon.log()
