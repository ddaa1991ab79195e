"""A started server (start_server) with the fake Engine and the probe service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from dualpace.serve.server import RunningServer, start_server
from tests.serve.fake_services import ENGINE_SERVICE, PROBE_SERVICE, FailingEngine, register_all


@dataclass
class Served:
    running: RunningServer
    engine: FailingEngine
    channel: grpc.aio.Channel


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    engine = FailingEngine()
    running = await start_server(
        "127.0.0.1:0", lambda server: register_all(server, engine), [ENGINE_SERVICE, PROBE_SERVICE]
    )
    async with grpc.aio.insecure_channel(running.address) as channel:
        yield Served(running, engine, channel)
    await running.stop(grace_s=None)
