"""The bytes of a cross-host KV transfer on a TCP data socket (blocking calls: run them in threads).

gRPC carries the header, the reservation, the layer checksums and the commit, as on the
same-host path (dualpace.engine.transfer.kv_shm_protocol); this socket carries only the KV itself, because
Python gRPC moves bulk bytes at a small fraction of memcpy (0.4-1.4 GB/s on loopback, whatever
the message sizes).

On the socket: the sender's hello (MAGIC + the import's one-time ticket), then every layer in
order, each as its K bytes in token order followed by its V bytes in token order; nothing else,
no reply (the commit over gRPC is the answer). Each side CRC32Cs a layer over its own memory
(shm_kv_copy.layer_checksums, the native loop) right next to moving it, and the target compares
its checksums with the sender's (sent with KvTcpWritten) before the commit.

The sender hands the kernel views of its pool's contiguous runs (sendmsg of up to MAX_IOV
buffers, no copy in Python). The target receives straight into its reserved blocks where its pool
is a contiguous host pool of the transfer's dtype (recvmsg_into on views of the pool), else into
one reusable staging buffer per transfer, written into the pool layer by layer (write_layer).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

import crc32c
import torch

from dualpace.engine.transfer.kv_checksum import kv_checksum
from dualpace.engine.transfer.same_host import TICKET_BYTES
from dualpace.engine.transfer.shm_kv_copy import layer_checksummer, slot_runs
from dualpace.errors import Unavailable

MAGIC = b"DPK1"
HELLO_BYTES = len(MAGIC) + TICKET_BYTES
SOCKET_BUFFER_BYTES = 4 * 2**20  # per direction: a few ms of data in flight at loopback speed
MAX_IOV = 512  # buffers per sendmsg / recvmsg_into call (Linux allows 1024)
CONNECT_TIMEOUT_S = 5.0
# The threads of the data sockets' blocking work (sends, receives): a pool of their own; TLS
# handshakes in another (a connection stalling its handshake holds one of those for up to
# HANDSHAKE_TIMEOUT_S, never a transfer's receive or the event loop's default executor).
POOL, POOL_WORKERS = "kv-tcp", 8
HELLO_POOL = "kv-tcp-hello"


def tune(connection: socket.socket) -> None:
    """No Nagle delay on the small tail of a layer; socket buffers large enough for a layer's runs."""
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def connect(host: str, port: int, ticket: bytes, timeout_s: float,
            tls: ssl.SSLContext | None = None) -> socket.socket:
    """The sender's connection to the target's data socket (over TLS with `tls`, the target's
    certificate checked for `host`), the hello sent."""
    connection = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    try:
        tune(connection)
        if tls is not None:
            connection = tls.wrap_socket(connection, server_hostname=host)
        connection.settimeout(timeout_s)
        connection.sendall(MAGIC + ticket)
    except BaseException:
        connection.close()
        raise
    return connection


def _advance(buffers: list[memoryview], num_bytes: int) -> list[memoryview]:
    """The buffers left after the first `num_bytes` of them were moved."""
    while num_bytes and buffers:
        if num_bytes >= len(buffers[0]):
            num_bytes -= len(buffers[0])
            buffers = buffers[1:]
        else:
            buffers = [buffers[0][num_bytes:], *buffers[1:]]
            num_bytes = 0
    return buffers


def send_all(connection: socket.socket, buffers: list[memoryview]) -> None:
    if isinstance(connection, ssl.SSLSocket):  # no sendmsg over TLS: one record stream per layer
        connection.sendall(b"".join(buffers))
        return
    buffers = [b for b in buffers if len(b)]
    while buffers:
        sent = connection.sendmsg(buffers[:MAX_IOV])
        buffers = _advance(buffers, sent)


def receive_all(connection: socket.socket, buffers: list[memoryview]) -> None:
    buffers = [b for b in buffers if len(b)]
    while buffers:
        if isinstance(connection, ssl.SSLSocket):  # no recvmsg_into over TLS: buffer by buffer
            received = connection.recv_into(buffers[0])
        else:
            received, _, _, _ = connection.recvmsg_into(buffers[:MAX_IOV], 0, socket.MSG_WAITALL)
        if received == 0:
            raise EOFError("the data socket closed before the whole KV arrived")
        buffers = _advance(buffers, received)


def _flat_bytes(pool: torch.Tensor):
    """[layers, blocks, block_size, heads, dim] -> a numpy view [layers, slots, token bytes] (no copy)."""
    layers, blocks, block_size = pool.shape[:3]
    raw = pool.view(torch.int16) if pool.dtype in (torch.bfloat16, torch.float16) else pool
    return raw.view(layers, blocks * block_size, -1).numpy().view("u1")


def direct_pool(pool: torch.Tensor) -> bool:
    """A pool the socket can read from or write into as it is (a contiguous host pool)."""
    return pool.device.type == "cpu" and pool.is_contiguous()


def _layer_views(k_flat, v_flat, layer: int, runs: list[tuple[int, int, int]]) -> list[memoryview]:
    return [memoryview(flat[layer, start:start + length]).cast("B")
            for flat in (k_flat, v_flat) for start, _, length in runs]


def send_layers(connection: socket.socket, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_ids: list[int],
                safe_point: Callable[[], None] = lambda: None, corrupt_layer: int | None = None,
                cut_after: int | None = None, drop_layer: int | None = None) -> list[int]:
    """Stream every layer of `slot_ids`; returns the layer checksums of what was read. `safe_point` runs
    before each layer (it raises to abandon the move); corrupt_layer / cut_after / drop_layer: test
    faults (one byte changed after its checksum was taken / the connection cut before that layer /
    that layer never sent)."""
    num_layers = k_pool.shape[0]
    direct = direct_pool(k_pool) and direct_pool(v_pool)
    runs = slot_runs(slot_ids, slot_ids)
    flats = (_flat_bytes(k_pool), _flat_bytes(v_pool)) if direct else None
    index = None if direct else torch.tensor(slot_ids, dtype=torch.long, device=k_pool.device)
    layer_checksum = layer_checksummer(k_pool, v_pool, slot_ids) if direct else None
    checksums = []
    for layer in range(num_layers):
        safe_point()
        if cut_after is not None and layer >= cut_after:
            raise Unavailable(f"fault injected: KV data socket cut after {cut_after} layers")
        if direct:
            crc = layer_checksum(layer)
            buffers = _layer_views(*flats, layer, runs)
        else:  # a device pool: the layer gathered to the host first
            parts = [pool[layer].view(-1, *pool.shape[3:]).index_select(0, index).cpu() for pool in (k_pool, v_pool)]
            buffers = [memoryview(_flat_bytes(part.view(1, 1, *part.shape))[0, 0]).cast("B") for part in parts]
            crc = kv_checksum(*buffers)
        if layer == corrupt_layer:
            first = bytearray(buffers[0])
            first[0] ^= 0x01
            buffers[0] = memoryview(first)
        if layer != drop_layer:
            send_all(connection, buffers)
        checksums.append(crc)
    return checksums


def receive_layers(connection: socket.socket, k_pool: torch.Tensor, v_pool: torch.Tensor, slot_ids: list[int],
                   layer_bytes: int, write_layer: Callable[[int, memoryview, memoryview], None] | None = None
                   ) -> list[int]:
    """Receive every layer into the slots; returns the layer checksums of what landed. write_layer
    None: straight into the (direct) pool; else through one staging buffer of `layer_bytes` (K + V of
    one layer), handed to write_layer(layer, k, v) after its checksum was taken."""
    num_layers = k_pool.shape[0]
    checksums = []
    if write_layer is None:
        runs = slot_runs(slot_ids, slot_ids)
        flats = _flat_bytes(k_pool), _flat_bytes(v_pool)
        layer_checksum = layer_checksummer(k_pool, v_pool, slot_ids)
        for layer in range(num_layers):
            receive_all(connection, _layer_views(*flats, layer, runs))
            checksums.append(layer_checksum(layer))
        return checksums
    staging = memoryview(bytearray(layer_bytes))
    half = layer_bytes // 2
    for layer in range(num_layers):
        receive_all(connection, [staging])
        checksums.append(crc32c.crc32c(staging))
        write_layer(layer, staging[:half], staging[half:])
    return checksums
