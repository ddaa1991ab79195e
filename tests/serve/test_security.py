"""Loopback by default, TLS beyond it, and the optional shared bearer token.

In-process servers on 127.0.0.1 for the interceptor and TLS; gpu_service as a real
process for the flags (a non-loopback --listen without TLS is refused before anything
binds) and for the token on its own RPCs and on the calls other daemons make to it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cpu_service.assist_client import AssistClient, AssistUnavailable
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvLayout, KvTransferHeader
from dualpace.errors import InvalidArgument, Unavailable
from dualpace.sampling import SamplingParams
from dualpace.serve.auth import aio_token_interceptors, read_token_file, token_metadata
from dualpace.serve.kv_transport import KvControlSender
from dualpace.serve.security import ServerSecurity, check_listen_security, load_tls
from dualpace.serve.server import start_server
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from router.engines import EngineHandle
from tests.serve.fake_services import (
    ENGINE_SERVICE,
    PROBE_SERVICE,
    FailingEngine,
    register_all,
)
from toolkit.processes import start_daemon

TOKEN = "s3cret-token"
HEALTH_REQUEST = health_pb2.HealthCheckRequest(service="")
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------------- flags and files


def test_token_file_errors(tmp_path: Path) -> None:
    assert read_token_file(None) is None
    with pytest.raises(InvalidArgument, match="--auth-token-file: cannot read"):
        read_token_file(tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidArgument, match="is empty"):
        read_token_file(tmp_path / "empty")
    (tmp_path / "two").write_text("two words")
    with pytest.raises(InvalidArgument, match="one word"):
        read_token_file(tmp_path / "two")


def test_tls_flags_come_in_pairs(tmp_path: Path) -> None:
    assert load_tls(None, None) is None
    with pytest.raises(InvalidArgument, match="--tls-key"):
        load_tls(str(tmp_path / "cert.pem"), None)
    with pytest.raises(InvalidArgument, match="--tls-cert"):
        load_tls(None, str(tmp_path / "key.pem"))
    with pytest.raises(InvalidArgument, match="--tls-client-ca"):
        load_tls(None, None, str(tmp_path / "ca.pem"))
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(InvalidArgument, match="--tls-cert: .* is not a PEM file"):
        load_tls(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:50051", "[::1]:0", "127.8.9.10:1"])
def test_loopback_needs_no_tls(listen: str) -> None:
    check_listen_security(listen, None)


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "10.1.2.3:50051", "gpu-host:50051"])
def test_non_loopback_needs_tls(listen: str) -> None:
    with pytest.raises(InvalidArgument, match="not a loopback address.*--tls-cert and --tls-key"):
        check_listen_security(listen, None)


async def test_start_server_refuses_non_loopback_without_tls() -> None:
    with pytest.raises(InvalidArgument, match="--listen: 0.0.0.0:0 is not a loopback address"):
        await start_server("0.0.0.0:0", lambda server: None, [])


def test_daemon_refuses_non_loopback_without_tls(synth_checkpoint) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpu_service", "--model", str(synth_checkpoint("tiny-llama")), "--dtype", "fp32",
         "--threads", "1", "--listen", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "listening on" not in result.stdout
    message = result.stderr.strip().splitlines()
    expected = ("gpu_service: error: --listen: 0.0.0.0:0 is not a loopback address; serving beyond this "
                "machine needs TLS: give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), "
                "or listen on 127.0.0.1")
    assert message == [expected], result.stderr


# ---------------------------------------------------------------------- the token, in process


@pytest.fixture
async def guarded():
    running = await start_server("127.0.0.1:0", lambda server: register_all(server, FailingEngine()),
                                 [ENGINE_SERVICE, PROBE_SERVICE], security=ServerSecurity(auth_token=TOKEN))
    yield running
    await running.stop(grace_s=None)


async def test_token_required_except_for_health(guarded) -> None:
    async with grpc.aio.insecure_channel(guarded.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Abort(engine_pb2.AbortRequest(request_id="ok"), metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # streaming handlers too
            async for _ in stub.Generate(new_request_to_pb("ok", [1], SamplingParams())):
                pass
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = await health_pb2_grpc.HealthStub(channel).Check(HEALTH_REQUEST)
        assert health.status == SERVING
        reply = await stub.Abort(engine_pb2.AbortRequest(request_id="ok"), metadata=token_metadata(TOKEN))
        assert reply.found


async def test_client_interceptors_add_the_token_to_every_kind(guarded) -> None:
    async with grpc.aio.insecure_channel(guarded.address, interceptors=aio_token_interceptors(TOKEN)) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        assert (await stub.Abort(engine_pb2.AbortRequest(request_id="ok"))).found  # unary-unary
        responses = [r async for r in stub.Generate(new_request_to_pb("ok", [1], SamplingParams()))]
        assert [list(r.token_ids) for r in responses] == [[1], [2]]  # unary-stream
        call = stub.ImportKv()  # stream-stream, driven with write/read as the KV sender does
        await call.write(engine_pb2.ImportKvMessage(header=engine_pb2.ImportKvHeader(request_id="ok")))
        reply = await call.read()
        assert reply.prepared.total_bytes == 1
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        collect = channel.stream_unary(f"/{PROBE_SERVICE}/Collect")  # stream-unary
        assert await collect(iter([b"a", b"b"])) == b"ab"


@pytest.mark.parametrize("kept", [False, True])
async def test_kv_sender_sends_the_token(guarded, kept: bool) -> None:
    from dualpace.serve.peer_channels import PeerChannels

    channels = PeerChannels() if kept else None  # kept: the token goes on each call, not the channel
    header = KvTransferHeader("ok", (1, 2), (3,), SamplingParams(seed=1), 0, KvLayout(1, 1, 4, 8, "float32"),
                              0, "source")

    no_kv = OutgoingKv(storage=None, slot_ids=[])  # a move without KV: no pool is read

    # The fake target answers 'prepared' to every message: past the token, the sender trips over
    # a reply that is not 'committed'; without it, the import ends at once (UNAUTHENTICATED, or
    # INTERNAL when the sender's next write races the server's early end of the stream).
    with pytest.raises(Unavailable, match="UNAUTHENTICATED|INTERNAL"):
        await KvControlSender(guarded.address, channels=channels)(header, no_kv)
    with pytest.raises(Unavailable, match="expected 'committed'"):
        await KvControlSender(guarded.address, auth_token=TOKEN, channels=channels)(header, no_kv)
    if channels is not None:
        await channels.close()


# ---------------------------------------------------------------------- TLS, in process


def _self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
async def test_tls_and_mutual_tls(tmp_path: Path) -> None:
    server_cert, server_key = _self_signed(tmp_path, "server")
    client_cert, client_key = _self_signed(tmp_path, "client")
    tls = load_tls(str(server_cert), str(server_key), str(client_cert))  # the client cert is its own CA
    running = await start_server("127.0.0.1:0", lambda server: register_all(server, FailingEngine()),
                                 [ENGINE_SERVICE], security=ServerSecurity(tls=tls))
    try:
        trusted = grpc.ssl_channel_credentials(root_certificates=server_cert.read_bytes(),
                                               private_key=client_key.read_bytes(),
                                               certificate_chain=client_cert.read_bytes())
        async with grpc.aio.secure_channel(running.address, trusted) as channel:
            assert (await health_pb2_grpc.HealthStub(channel).Check(HEALTH_REQUEST, timeout=10)).status == SERVING
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=server_cert.read_bytes())
        async with grpc.aio.secure_channel(running.address, no_client_cert) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await health_pb2_grpc.HealthStub(channel).Check(HEALTH_REQUEST, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(running.address) as channel:  # plaintext to a TLS port
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(channel).Check(HEALTH_REQUEST, timeout=5)
    finally:
        await running.stop(grace_s=None)


# ---------------------------------------------------------------------- gpu_service with a token


def test_gpu_service_with_token(synth_checkpoint, token_file: Path) -> None:
    daemon = start_daemon("gpu_service", "--model", str(synth_checkpoint("tiny-llama")), "--dtype", "fp32",
                          "--threads", "1", "--kv-blocks", "64", "--block-size", "8",
                          "--auth-token-file", str(token_file))
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert health_pb2_grpc.HealthStub(channel).Check(HEALTH_REQUEST, timeout=10).status == SERVING
            request = new_request_to_pb("t", [5, 9, 2], SamplingParams(max_tokens=3, ignore_eos=True))
            tokens = [t for r in stub.Generate(request, metadata=token_metadata(TOKEN), timeout=30)
                      for t in r.token_ids]
            assert len(tokens) == 3

        # The router's engine handle sends the token on Info and WatchLoad; without it, no view.
        async def router_view(token: str | None):
            handle = EngineHandle(daemon.address, "gpu", token)
            handle.start()
            try:
                for _ in range(100):
                    if handle.view is not None:
                        break
                    await asyncio.sleep(0.02)
                return handle.view
            finally:
                await handle.close()

        view = asyncio.run(router_view(TOKEN))
        assert view is not None and view.healthy and view.kv_blocks_total == 64
        assert asyncio.run(router_view(None)) is None

        # Dense Assist from the CPU engine: without the token the server refuses the stream.
        with AssistClient(daemon.address, iteration_timeout_s=10) as client:
            with pytest.raises(AssistUnavailable) as refused:
                client.run_iteration([5], [0], lambda *a: pytest.fail("no layer without the token"))
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        with AssistClient(daemon.address, iteration_timeout_s=10, auth_token=TOKEN) as client, \
                pytest.raises(RuntimeError, match="attended"):  # the token got the stream to layer 0
            client.run_iteration([5], [0], _attend_then_stop)
    finally:
        status = daemon.stop()
    assert status == 0, daemon.log()


def _attend_then_stop(layer, q, k, v):
    raise RuntimeError(f"attended layer {layer}")
