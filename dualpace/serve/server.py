"""Start a daemon's grpc.aio server: interceptor, health, reflection, bind, start.

    running = await start_server("127.0.0.1:0", register, ["dualpace.v1.Engine"])
    print_listening("gpu_service", running.address)
    ...
    await running.stop(grace_s=5.0)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dualpace.errors import InvalidArgument
from dualpace.serve.address import ListenAddress
from dualpace.serve.auth import AuthInterceptor
from dualpace.serve.interceptor import StatusInterceptor
from dualpace.serve.security import ServerSecurity, TlsConfig, check_listen_security
from dualpace.serve.unix_socket import bind_private, prepare_path


# A long request's messages are large (its token ids, prompt logprobs, a transfer's slot ids);
# 64 MiB leaves room for them.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options() -> list[tuple[str, int]]:
    """Client channel options whose message limits match the servers'."""
    return [
        ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
    ]

OVERALL_HEALTH = ""  # the health service name that stands for the whole server

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RunningServer:
    """A started server, the address it is bound to, and its health switch."""

    def __init__(
        self,
        server: grpc.aio.Server,
        address: str,
        listen: ListenAddress,
        health_servicer: health.aio.HealthServicer,
        service_names: Sequence[str],
    ):
        self.server = server
        self.address = address  # "host:port" a local client connects to (the real port)
        self.listen = listen  # what was asked for (port may be 0)
        self.health_servicer = health_servicer
        self.service_names = list(service_names)

    @property
    def port(self) -> int:
        """The TCP port actually bound."""
        return int(self.address.rsplit(":", 1)[1])

    async def set_serving(self, serving: bool) -> None:
        """Sets health of the server ("") and every service to SERVING or NOT_SERVING."""
        status = _SERVING if serving else _NOT_SERVING
        for name in [OVERALL_HEALTH, *self.service_names]:
            await self.health_servicer.set(name, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Reports NOT_SERVING for good, then stops; in-flight calls get `grace_s` to finish.

        From its first moment the server takes no new call, health checks included (clients
        see UNAVAILABLE or CANCELLED, not NOT_SERVING). A daemon that drains its own work
        while still answering health and refusals does so first (set_serving(False), then
        wait) and calls stop() with a short grace afterwards."""
        await self.health_servicer.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        """Returns when the server has stopped."""
        await self.server.wait_for_termination()


async def start_server(
    listen: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_receive_bytes: int | None = None,
    listen_field: str = "--listen",
    security: ServerSecurity | None = None,
) -> RunningServer:
    """Creates, binds and starts a grpc.aio server; returns it SERVING.

    `register(server)` adds the daemon's servicers (e.g. add_EngineServicer_to_server);
    `service_names` are their full names ("dualpace.v1.Engine"), used for health
    and reflection. Port 0 binds a free port; `RunningServer.address` has the
    real one. A malformed or unbindable address raises InvalidArgument(listen_field, ...).

    `security`: with TLS the port is bound with grpc.ssl_server_credentials (mTLS
    when a client CA is given); without it only a loopback address is accepted
    (InvalidArgument otherwise). With an auth token every RPC but health must
    carry it (dualpace.serve.auth).

    `max_receive_bytes` (default: max_message_bytes) bounds what the server receives: a larger
    request is refused with RESOURCE_EXHAUSTED by gRPC's core, before any of it reaches Python.
    """
    security = security or ServerSecurity()
    address = check_listen_security(listen, security.tls, listen_field)
    interceptors: list[grpc.aio.ServerInterceptor] = [StatusInterceptor()]
    if security.auth_token is not None:
        interceptors.insert(0, AuthInterceptor(security.auth_token))  # outermost: nothing runs unauthenticated
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes if max_receive_bytes is None else max_receive_bytes),
            # Without this a second daemon on the same fixed port binds silently.
            ("grpc.so_reuseport", 0),
        ],
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = _bind(server, address, listen_field, security.tls)
    await server.start()
    running = RunningServer(server, address.connect_target(port), address, health_servicer, service_names)
    await running.set_serving(True)
    return running


def print_listening(name: str, address: str) -> None:
    """Prints `{name} listening on {address}` on stdout; launchers and tests parse this line. It is
    not logged as well: a launcher that relays both streams (`dualpace up`, systemd's journal)
    would show it twice."""
    line = f"{name} listening on {address}"
    # One write with its newline: print() writes the text and the newline apart, and unbuffered
    # (PYTHONUNBUFFERED) another thread's log line on the same pipe could land between them
    # ("...cpu.sock{"event": ...}"), which a launcher then parsed as the address.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _bind(server: grpc.aio.Server, address: ListenAddress, listen_field: str, tls: TlsConfig | None) -> int:
    """Binds a TLS port when tls is given, else an insecure one; returns the port number bound."""
    target = address.target()
    problem = f"cannot bind {target}: address in use or not available"
    if tls is not None:
        problem += " (or the TLS certificate and key do not match)"

    def bind() -> int:
        return server.add_secure_port(target, tls.server_credentials()) if tls else server.add_insecure_port(target)

    try:
        if address.is_unix:  # private to this user (0600); grpc reports port 1 for a bound socket
            prepare_path(address.unix_path, listen_field)
            port = bind_private(bind, address.unix_path)
        else:
            port = bind()
    except RuntimeError as exc:
        raise InvalidArgument(listen_field, problem) from exc
    if port == 0:  # older grpcio reports a failed bind this way
        raise InvalidArgument(listen_field, problem)
    return port
