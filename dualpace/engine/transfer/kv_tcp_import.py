"""The target's half of a cross-host KV transfer: a TCP data socket, tickets, and the receive.

The daemon listens on one TCP port of its own host (TcpDataServer), advertised per import in
the reservation over gRPC (KvTcpReserved). An import opens a one-time ticket there after its
blocks are reserved; the first connection that presents it gets the import's receive, any other
(a wrong, replayed or revoked ticket, or not this protocol) is closed without reading further.
The two-phase rules of dualpace.engine.transfer.migration hold unchanged: the bytes land only in blocks
reserved for this import, which no step reads until the commit; verification happens before
the commit; and when the import ends otherwise, the ticket is revoked and the connection shut
down, and the blocks are freed only after the receive thread has stopped writing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from dataclasses import dataclass

from dualpace.engine.transfer import kv_tcp_data
from dualpace.engine.transfer.kv_bytes import DTYPE_NAMES, tensor_from_bytes
from dualpace.engine.transfer.migration import KvImporter
from dualpace.engine.transfer.same_host import HANDSHAKE_TIMEOUT_S, accept_forever, new_ticket, recv_exactly
from dualpace.engine.transfer.worker_pools import run_in_pool
from dualpace.errors import InvalidArgument

log = logging.getLogger(__name__)

RECEIVE_TIMEOUT_S = 120.0  # a stalled sender: the receive gives up (the import's gRPC deadline is the same)


@dataclass(frozen=True)
class TcpReservation:
    port: int
    ticket: bytes
    tls: bool = False  # the data socket speaks TLS


@dataclass(frozen=True)
class TcpDeclined:
    reason: str


@dataclass(frozen=True)
class TcpWritten:
    layer_crc32s: tuple[int, ...]
    commit: bool = False


class TcpDataServer:
    """The listening data socket and the tickets of the imports waiting for their connection."""

    def __init__(self, listener: socket.socket, tls: ssl.SSLContext | None = None):
        self._listener = listener
        self.tls = tls  # the daemon's TLS (its --tls-cert): every connection is wrapped before its hello
        self.port = listener.getsockname()[1]
        self._waiting: dict[bytes, asyncio.Future] = {}  # ticket -> the import's connection
        self._tasks: set[asyncio.Task] = set()
        self._accepting: asyncio.Task | None = None
        self.num_refused = 0  # connections closed for a bad hello (the tests read it)

    @classmethod
    async def start(cls, host: str, tls: ssl.SSLContext | None = None) -> TcpDataServer:
        """Listen on `host` (the daemon's own gRPC host; never a wider one) at an ephemeral port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family, backlog=64)
        listener.setblocking(False)
        server = cls(listener, tls)
        server._accepting = asyncio.create_task(server._accept_loop())
        log.info("KV data socket open: host %s, port %d", host, server.port)
        return server

    def open(self) -> tuple[bytes, asyncio.Future]:
        ticket = new_ticket()
        self._waiting[ticket] = asyncio.get_running_loop().create_future()
        return ticket, self._waiting[ticket]

    def revoke(self, ticket: bytes) -> None:
        """No connection for this ticket from now on (a connection handed over already stays)."""
        waiting = self._waiting.pop(ticket, None)
        if waiting is not None and not waiting.done():
            waiting.cancel()

    async def close(self) -> None:
        for task in [self._accepting, *self._tasks]:
            if task is not None:
                task.cancel()
        for ticket in list(self._waiting):
            self.revoke(ticket)
        self._listener.close()

    async def _accept_loop(self) -> None:
        await accept_forever(self._listener, self._hello, self._tasks, "KV data socket")

    async def _hello(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        connection.setblocking(False)
        try:
            if self.tls is not None:  # the handshake and the hello in a thread (blocking, bounded)
                connection, hello = await run_in_pool(kv_tcp_data.HELLO_POOL, _tls_hello, self.tls, connection,
                                                       max_workers=kv_tcp_data.POOL_WORKERS)
            else:
                hello = await asyncio.wait_for(recv_exactly(loop, connection, kv_tcp_data.HELLO_BYTES),
                                               HANDSHAKE_TIMEOUT_S)
            magic, ticket = hello[:len(kv_tcp_data.MAGIC)], hello[len(kv_tcp_data.MAGIC):]
            waiting = self._waiting.pop(ticket, None) if magic == kv_tcp_data.MAGIC else None
            if waiting is None or waiting.done():
                self.num_refused += 1
                log.warning("KV data socket: a connection without a valid ticket was closed")
                return
            kv_tcp_data.tune(connection)
            connection.setblocking(True)
            connection.settimeout(RECEIVE_TIMEOUT_S)
            waiting.set_result(connection)
            connection = None  # the import's now
        except (OSError, EOFError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            log.debug("KV data socket: hello failed: %s", exc)
        finally:
            if connection is not None:
                connection.close()


def _tls_hello(tls: ssl.SSLContext, connection: socket.socket) -> tuple[socket.socket, bytes]:
    """Blocking: the TLS handshake (the client's certificate checked where the context requires
    one), then the hello; the connection is closed on any failure."""
    try:
        connection.setblocking(True)
        connection.settimeout(HANDSHAKE_TIMEOUT_S)
        connection = tls.wrap_socket(connection, server_side=True)
        hello = b""
        while len(hello) < kv_tcp_data.HELLO_BYTES:
            more = connection.recv(kv_tcp_data.HELLO_BYTES - len(hello))
            if not more:
                raise EOFError("closed before the hello")
            hello += more
    except BaseException:
        connection.close()
        raise
    return connection, hello


class TcpImport:
    """One import's data-socket side, beside its KvImporter."""

    def __init__(self, server: TcpDataServer | None, importer: KvImporter, declined: str | None = None):
        self.server = server
        self.importer = importer
        self.declined = declined or (None if server is not None else "the target has no KV data socket")
        self._ticket: bytes | None = None
        self._connection: socket.socket | None = None
        self._receive: asyncio.Future | None = None  # the landed checksums (None: no connection came)
        self._closing = False

    def answer(self) -> TcpReservation | TcpDeclined:
        """After importer.begin reserved the blocks: where the sender may stream them, or why not."""
        if self.declined is not None:
            return TcpDeclined(self.declined)
        self._ticket, waiting = self.server.open()
        self._receive = asyncio.ensure_future(self._accept_and_receive(waiting))
        return TcpReservation(self.server.port, self._ticket, self.server.tls is not None)

    async def _accept_and_receive(self, waiting: asyncio.Future) -> list[int] | None:
        """The landed layer checksums, once the ticket's connection came and the whole KV arrived;
        None if no connection came before the ticket was revoked."""
        try:
            connection = await waiting
        except asyncio.CancelledError:
            return None  # revoked (the import ended): never connected
        if self._closing:  # handed over just as the import ended: nothing is received
            connection.close()
            return None
        self._connection = connection
        kv = self.importer.loop.core.runner.kv
        header = self.importer.progress.header
        slot_ids = self._sent_slot_ids()
        layer_bytes = 2 * len(slot_ids) * header.layout.bytes_per_token_per_layer
        direct = (kv_tcp_data.direct_pool(kv.k) and kv_tcp_data.direct_pool(kv.v)
                  and DTYPE_NAMES[kv.dtype] == header.layout.dtype)
        write_layer = None if direct else functools.partial(self._write_layer, slot_ids)  # the slots built once
        return await run_in_pool(kv_tcp_data.POOL, kv_tcp_data.receive_layers, connection, kv.k, kv.v,
                                 slot_ids, layer_bytes, write_layer,
                                 max_workers=kv_tcp_data.POOL_WORKERS)

    def _sent_slot_ids(self) -> list[int]:
        """The slots of the tokens the sender streams: all of them, or (a cache-only import that skips
        what this engine holds already) those after the held ones."""
        return self.importer.slot_ids[self.importer.progress.first_token:]

    def _write_layer(self, slot_ids: list[int], layer: int, k: memoryview, v: memoryview) -> None:
        """The staging path: one layer's bytes into the reserved blocks (another dtype or a device pool)."""
        header = self.importer.progress.header
        shape = (len(slot_ids), header.layout.num_kv_heads, header.layout.head_dim)
        self.importer.loop.core.runner.write_kv(slot_ids, layer,
                                                tensor_from_bytes(k, header.layout.dtype, shape),
                                                tensor_from_bytes(v, header.layout.dtype, shape))

    async def written(self, written: TcpWritten) -> None:
        """Wait for the whole KV, verify what landed; then the import is complete (commit may follow).
        The connection may still be on its way (the sender's bytes sit in socket buffers): its ticket
        stays open until it comes or the import ends."""
        if self._receive is None:
            raise InvalidArgument("tcp_written", "no data-socket reservation was made for this import")
        try:
            landed = await asyncio.shield(self._receive)
        except (OSError, EOFError) as exc:
            raise InvalidArgument("tcp_written", f"the data socket failed: {exc}") from exc
        if landed is None:
            raise InvalidArgument("tcp_written", "no data connection came with this import's ticket")
        layout = self.importer.progress.header.layout
        if len(written.layer_crc32s) != layout.num_layers:
            raise InvalidArgument("tcp_written.layer_crc32",
                                  f"{len(written.layer_crc32s)} checksums for {layout.num_layers} layers")
        for layer, (expected, actual) in enumerate(zip(written.layer_crc32s, landed)):
            if expected != actual:
                raise InvalidArgument("tcp_written.layer_crc32", f"checksum mismatch in layer {layer}")
        self.importer.progress.accept_in_place()
        self._close_connection()

    def _close_connection(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.close()
            self._connection = None

    async def close(self) -> None:
        """Before importer.cancel: the ticket revoked and the receive stopped, so no byte lands in the
        blocks it frees. Shielded (this runs in the cleanup of a cancelled RPC)."""
        self._closing = True
        if self._ticket is not None:
            self.server.revoke(self._ticket)
        if self._receive is not None and not self._receive.done() and self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.shutdown(socket.SHUT_RDWR)  # a blocked receive returns at once
        if self._receive is not None:
            await asyncio.shield(asyncio.gather(self._receive, return_exceptions=True))
        self._close_connection()
