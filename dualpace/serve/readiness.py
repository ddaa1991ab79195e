"""How a launcher knows a daemon is ready: its "NAME listening on ADDR" line
(printed by dualpace.serve.server.print_listening), then health SERVING."""

from __future__ import annotations

import re
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LISTENING = re.compile(r"listening on (\S+)")


def wait_serving(address: str, timeout_s: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Poll the gRPC health service until it reports SERVING (RuntimeError after timeout_s);
    over TLS with `credentials` (a daemon that serves TLS), else plaintext."""
    deadline = time.monotonic() + timeout_s
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} never became SERVING")
            time.sleep(0.1)
