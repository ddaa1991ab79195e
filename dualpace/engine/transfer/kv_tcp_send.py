"""The sender's half of a cross-host KV transfer: connect to the target's data socket with the
import's ticket and stream every layer of the outgoing slots (dualpace.engine.transfer.kv_tcp_data),
in the data sockets' threads. The control messages around it (the offer, the reservation, the
layer checksums, the commit) are the caller's: dualpace.serve.kv_tcp_transport over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading

from dualpace.engine.transfer import kv_tcp_data
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_tcp_import import TcpReservation
from dualpace.engine.transfer.worker_pools import run_in_pool
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig


async def send_over_data_socket(host: str, reservation: TcpReservation, outgoing: OutgoingKv, timeout_s: float,
                                tls: ssl.SSLContext | None = None, faults: FaultConfig | None = None,
                                peer: str | None = None) -> list[int]:
    """Stream the KV to the data socket at `host`, reservation.port; returns the layer checksums of
    what was sent. Raises Unavailable naming `peer` (default: the host) and the step that failed (the
    connection, or the stream);
    what outgoing.safe_point raises (an abandoned move) as it is. Once cancelled, returns only after
    the sending thread has stopped (the connection shut down: a blocked send returns at once).
    `faults`: the test faults of dualpace.faults that break a layer on the way."""
    faults = faults or FaultConfig()
    peer = peer or host
    try:
        connection = await run_in_pool(kv_tcp_data.POOL, kv_tcp_data.connect, host, reservation.port,
                                       reservation.ticket, timeout_s, tls, max_workers=kv_tcp_data.POOL_WORKERS)
    except OSError as exc:
        raise Unavailable(f"KV to {peer}: cannot reach its data socket (port {reservation.port}): {exc}") from exc
    stop = threading.Event()

    def safe_point() -> None:
        if stop.is_set():
            raise InterruptedError("KV stream stopped")
        outgoing.safe_point()  # raises once the move is abandoned (an Event read: safe from a thread)

    storage = outgoing.storage
    job = asyncio.ensure_future(run_in_pool(
        kv_tcp_data.POOL, kv_tcp_data.send_layers, connection, storage.k, storage.v, list(outgoing.slot_ids),
        safe_point, faults.kv_corrupt_layer, faults.kv_cut_after_layers, faults.kv_drop_layer,
        max_workers=kv_tcp_data.POOL_WORKERS))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(OSError):
            connection.shutdown(2)  # SHUT_RDWR
        await asyncio.gather(job, return_exceptions=True)
        raise
    except OSError as exc:
        raise Unavailable(f"KV data socket to {peer} failed: {exc}") from exc
    finally:
        connection.close()
