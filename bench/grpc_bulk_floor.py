"""The floor under KV over gRPC: bare bytes through one client stream on loopback, no protobuf, no KV work.

    python -m bench.grpc_bulk_floor [--total-mb 24] [--message-mb 0.75 --message-mb 4 ...] [--out F.json]

A grpc.aio server subprocess (as the engines' daemons) counts what one client-streaming call sends;
the client writes `--total-mb` in messages of each size (random bytes, identity serializers), with
grpc.aio as GrpcKvSender does and with the sync stub for comparison. Best of 5 per point. The
default total is a 1024-token context of the default model in bf16 (23.6 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import grpc

from bench.floor_server import identity, served
from dualpace.serve.server import DEFAULT_MAX_MESSAGE_BYTES

METHOD = "/floor.Bulk/Sink"
OPTIONS = [("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
           ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES)]
BEST_OF = 5


async def _serve() -> None:
    async def sink(request_iterator, context):
        received = 0
        async for message in request_iterator:
            received += len(message)
        return received.to_bytes(8, "little")

    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "floor.Bulk", {"Sink": grpc.stream_unary_rpc_method_handler(sink, identity, identity)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace=None)


async def _aio_gbps(address: str, message: bytes, count: int) -> float:
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        best_s = float("inf")
        for _ in range(BEST_OF):
            start = time.perf_counter()
            call = channel.stream_unary(METHOD, identity, identity)()
            for _ in range(count):
                await call.write(message)
            await call.done_writing()
            await call
            best_s = min(best_s, time.perf_counter() - start)
    return len(message) * count / best_s / 1e9


def _sync_gbps(address: str, message: bytes, count: int) -> float:
    with grpc.insecure_channel(address, options=OPTIONS) as channel:
        best_s = float("inf")
        for _ in range(BEST_OF):
            start = time.perf_counter()
            channel.stream_unary(METHOD, identity, identity)(iter([message] * count))
            best_s = min(best_s, time.perf_counter() - start)
    return len(message) * count / best_s / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_bulk_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mb", type=float, default=23.6)
    parser.add_argument("--message-mb", type=float, action="append", help="message size (repeatable; default 0.75, 4, 8)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve())
        return 0
    points = []
    with served("bench.grpc_bulk_floor") as address:
        for message_mb in args.message_mb or (0.75, 4.0, 8.0):
            message = os.urandom(int(message_mb * 1e6))
            count = max(1, round(args.total_mb / message_mb))
            point = {"message_mb": message_mb, "aio_gbps": round(asyncio.run(_aio_gbps(address, message, count)), 3),
                     "sync_gbps": round(_sync_gbps(address, message, count), 3)}
            points.append(point)
            print(f"{message_mb:6.2f} MB messages: aio {point['aio_gbps']:.2f} GB/s, sync {point['sync_gbps']:.2f} GB/s")
    result = {"total_mb": args.total_mb, "points": points, "load_average_1m": round(os.getloadavg()[0], 2)}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
