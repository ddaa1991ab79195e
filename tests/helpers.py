"""Helpers shared by the tests (fixtures live in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_tcp_import import TcpDataServer, TcpImport, TcpWritten
from dualpace.engine.transfer.kv_tcp_send import send_over_data_socket
from dualpace.engine.transfer.kv_transfer import KvTransferHeader
from dualpace.engine.transfer.migration import KvImporter
from dualpace.faults import FaultConfig
from dualpace.generation import OfflineGenerator
from dualpace.sampling import SamplingParams

T = TypeVar("T")


def reference_tokens(loaded, prompt: list[int], params: SamplingParams, block_size: int | None = None) -> list[int]:
    """What the request generates alone, in process (the OfflineGenerator reference path)."""
    generator = OfflineGenerator(loaded) if block_size is None else OfflineGenerator(loaded, block_size=block_size)
    return generator.generate([list(prompt)], [params])[0].output_token_ids


def wait_for(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, interval_s: float = 0.01) -> T:
    """Poll `probe` until `done(value)` or `timeout_s` is up; returns the last value (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Yield to the event loop until `condition()` holds; fails naming `what` past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.001)


async def import_over_data_socket(importer: KvImporter, header: KvTransferHeader,
                                  outgoing_from: Callable[[int], OutgoingKv], faults: FaultConfig | None = None,
                                  hold: Callable[[str], Awaitable[None]] | None = None) -> str:
    """One import into an in-process target over the shipped cross-host path, the ImportKv servicer's
    steps made as calls (no gRPC): reserve, the KV after the tokens the target holds over its data
    socket on loopback (TcpDataServer, TcpImport; the sender's send_over_data_socket), verify, commit.
    Returns the target engine's name. `faults`: the sender's test faults (dualpace.faults);
    `hold(phase)` is awaited at "before_begin", "reserved", "verified" and "committed"."""
    hold = hold or _no_hold
    server = await TcpDataServer.start("127.0.0.1")
    tcp = TcpImport(server, importer)
    try:
        await hold("before_begin")
        await importer.begin(header)
        await hold("reserved")
        num_held = importer.progress.first_token
        if header.num_computed_tokens > num_held:  # else: no KV to send (moved without it, or all held)
            outgoing = outgoing_from(num_held)
            checksums = await send_over_data_socket("127.0.0.1", tcp.answer(), outgoing, 30.0, faults=faults)
            outgoing.safe_point()  # the sender's last chance to back out: the commit follows
            await tcp.written(TcpWritten(tuple(checksums)))
        await hold("verified")
        name = await importer.commit()
        await hold("committed")
        return name
    finally:
        await tcp.close()
        await importer.cancel()
        await server.close()


async def _no_hold(phase: str) -> None:
    pass


def data_socket_send(target: EngineLoop, faults: FaultConfig | None = None,
                     hold: Callable[[str], Awaitable[None]] | None = None):
    """migrate_out's `send` to an in-process target: import_over_data_socket."""

    async def send(header: KvTransferHeader, outgoing: OutgoingKv) -> str:
        return await import_over_data_socket(KvImporter(target), header, lambda _: outgoing, faults, hold)

    return send
