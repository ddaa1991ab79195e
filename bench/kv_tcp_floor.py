"""The TCP data socket's floor over loopback, alternated with memcpy in the same minutes.

Three things per round, on the same bytes (a 1024-token context of the default model's KV shape
by default: 30 layers, 3 KV heads, head_dim 64, bf16: 23.6 MB):
- memcpy: torch's copy of a buffer of that size into another;
- plain: one sendall of the whole buffer over a loopback socket into one recv_into loop (the
  bare floor of Python + the kernel's TCP path, no checksum, no layout);
- kv: dualpace.engine.transfer.kv_tcp_data.send_layers -> receive_layers between two KV pools (what the
  migration streams: views of the pool's runs, CRC32C per layer on both sides).
No gRPC and no engine here (bench.data_plane times the whole transfer, header to commit).

    python -m bench.kv_tcp_floor --rounds 5

The last output line is one JSON object: medians (GB/s) and each round's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time

import torch

from dualpace.engine.transfer import kv_tcp_data
from dualpace.kv.storage import KVStorage


def _over_loopback(receive, send) -> float:
    """Seconds from connect to the receiver's end of `receive(connection)` after `send(connection)`."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection:
            kv_tcp_data.tune(connection)
            receive(connection)
        done.set()

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(listener.getsockname()) as connection:
        kv_tcp_data.tune(connection)
        start = time.perf_counter()
        send(connection)
    thread.join()
    listener.close()
    return time.perf_counter() - start


def plain(num_bytes: int) -> float:
    data, received = bytearray(os.urandom(1024) * (num_bytes // 1024)), bytearray(num_bytes)

    def receive(connection) -> None:
        view, got = memoryview(received), 0
        while got < num_bytes:
            got += connection.recv_into(view[got:])
    return num_bytes / _over_loopback(receive, lambda c: c.sendall(data)) / 1e9


def kv(source: KVStorage, target: KVStorage, num_tokens: int) -> float:
    slots, crcs = list(range(num_tokens)), {}
    layer_bytes = 2 * num_tokens * source.num_kv_heads * source.head_dim * source.k.element_size()

    def receive(connection) -> None:
        crcs["in"] = kv_tcp_data.receive_layers(connection, target.k, target.v, slots, layer_bytes)

    def send(connection) -> None:
        crcs["out"] = kv_tcp_data.send_layers(connection, source.k, source.v, slots)
    seconds = _over_loopback(receive, send)
    if crcs["in"] != crcs["out"]:
        raise RuntimeError("the received KV differs from the sent KV")
    return layer_bytes * source.num_layers / seconds / 1e9


def memcpy(num_bytes: int) -> float:
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    dst.copy_(src)
    return num_bytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    blocks = -(-args.tokens // 16)
    source, target = (KVStorage(args.layers, blocks, 16, args.kv_heads, args.head_dim, torch.bfloat16)
                      for _ in range(2))
    source.k.copy_(torch.randn(source.k.shape))
    source.v.copy_(torch.randn(source.v.shape))
    num_bytes = 2 * args.layers * args.tokens * args.kv_heads * args.head_dim * 2
    rounds = []
    for _ in range(args.rounds):  # alternated: each round has all three, back to back
        rounds.append({"memcpy_gbps": memcpy(num_bytes), "plain_tcp_gbps": plain(num_bytes),
                       "kv_tcp_gbps": kv(source, target, args.tokens)})
        print(json.dumps({k: round(v, 3) for k, v in rounds[-1].items()}))
    result = {f"median_{k}": round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    result.update(num_bytes=num_bytes, rounds=rounds, load_average=os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
