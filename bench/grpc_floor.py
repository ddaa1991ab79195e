"""The floor under Dense Assist over gRPC: a bare bidi echo of the same message sizes, no protobuf.

    python -m bench.grpc_floor                          # batch 8 sizes, every client mode, aio server
    python -m bench.grpc_floor --batch 1 --batch 32 --server sync --out floor.json

A server subprocess (grpc.aio, as gpu_service's, or the sync thread-pool server) answers each
message of one stream at once with a prepared reply of q/k/v's size; bytes cross as they are
(identity serializers). The client times one round trip: send the attention output's bytes,
wait for the reply. Client modes:

- `thread-stream`: the sync stub with a queue-fed request iterator and a reader thread (the
  structure of cpu_service/assist_client.py before session 9: caller -> gRPC's consumer thread,
  reader thread -> caller);
- `direct-stream`: the sync stub, the caller reads the reply iterator itself (no reader thread);
- `aio-loop-thread`: a grpc.aio stream on an event loop in a thread of its own; the caller
  submits each round trip with run_coroutine_threadsafe;
- `aio-inline`: the whole exchange in one coroutine on the caller's loop (no thread hop at all;
  the floor of aio on both ends, not usable from the engine's worker thread as it stands);
- `aio-inline-beside-server`: aio-inline while another thread's loop serves a grpc.aio server, as
  in cpu_service (the process's one grpc.aio poller wakes every loop bound to it);
- `unary`: one blocking unary call per round trip on the caller's thread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import sys
import threading
import time

import grpc

from bench.floor_server import identity, leave_result, served
from dualpace.stats import percentile

METHOD_STREAM = "/floor.Echo/Stream"
METHOD_UNARY = "/floor.Echo/Unary"
MODES = ("thread-stream", "direct-stream", "aio-loop-thread", "aio-inline", "aio-inline-beside-server", "unary")
# The default model's (SmolLM2-135M) per-layer bytes per row, bf16: up attention output 576 x 2,
# down q [9, 64], k and v [3, 64] x 2.
UP_BYTES_PER_ROW = 576 * 2
DOWN_BYTES_PER_ROW = (9 + 3 + 3) * 64 * 2
_END = object()
SERVERS = ("aio", "aio-hop", "sync")  # aio-hop: each reply made in a pool thread (the stage hop)


def _handlers(reply_for, hop_pool=None):
    def stream(request_iterator, context):
        for request in request_iterator:
            yield reply_for(request)

    async def stream_aio(request_iterator, context):
        async for request in request_iterator:
            yield reply_for(request)

    async def stream_aio_hop(request_iterator, context):  # each reply made in a pool thread, as the servicer's stages
        loop = asyncio.get_running_loop()
        async for request in request_iterator:
            yield await loop.run_in_executor(hop_pool, reply_for, request)

    def unary(request, context):
        return reply_for(request)

    async def unary_aio(request, context):
        return reply_for(request)

    return stream, stream_aio_hop if hop_pool is not None else stream_aio, unary, unary_aio


def _serve(kind: str, options: tuple = ()) -> None:
    replies: dict[int, bytes] = {}

    def reply_for(request: bytes) -> bytes:  # the request's first 4 bytes say the batch
        batch = int.from_bytes(request[:4], "little")
        reply = replies.get(batch)
        if reply is None:
            reply = replies[batch] = bytes(DOWN_BYTES_PER_ROW * batch)
        return reply

    from concurrent.futures import ThreadPoolExecutor
    stream, stream_aio, unary, unary_aio = _handlers(reply_for, ThreadPoolExecutor(4) if kind == "aio-hop" else None)
    aio = kind.startswith("aio")
    handler = grpc.method_handlers_generic_handler("floor.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(stream_aio if aio else stream, identity, identity),
        "Unary": grpc.unary_unary_rpc_method_handler(unary_aio if aio else unary, identity, identity)})
    if aio:
        async def run() -> None:
            server = grpc.aio.server(options=options)
            server.add_generic_rpc_handlers((handler,))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            print(port, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            await server.stop(grace=None)
        asyncio.run(run())
        return
    server = grpc.server(ThreadPoolExecutor(4), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(None)


def _request(batch: int) -> bytes:
    return batch.to_bytes(4, "little") + bytes(UP_BYTES_PER_ROW * batch - 4)


def _time(round_trip, batch: int, count: int, warmup: int) -> list[float]:
    request = _request(batch)
    for _ in range(warmup):
        round_trip(request)
    times_us = []
    for _ in range(count):
        start = time.perf_counter()
        round_trip(request)
        times_us.append((time.perf_counter() - start) * 1e6)
    return times_us


def _thread_stream(channel, batch, count, warmup, direct: bool) -> list[float]:
    requests: queue.Queue = queue.Queue()

    def request_iterator():
        while (item := requests.get()) is not _END:
            yield item

    call = channel.stream_stream(METHOD_STREAM, identity, identity)(request_iterator())
    if direct:
        def round_trip(request):
            requests.put(request)
            next(call)
    else:
        replies: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [replies.put(r) for r in call], daemon=True).start()

        def round_trip(request):
            requests.put(request)
            replies.get()
    try:
        return _time(round_trip, batch, count, warmup)
    finally:
        requests.put(_END)
        call.cancel()


def _aio_loop_thread(address, batch, count, warmup, options=()) -> list[float]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def open_call():
        channel = grpc.aio.insecure_channel(address, options=options)
        return channel, channel.stream_stream(METHOD_STREAM, identity, identity)()

    channel, call = asyncio.run_coroutine_threadsafe(open_call(), loop).result()

    async def exchange(request):
        await call.write(request)
        return await call.read()

    def round_trip(request):
        asyncio.run_coroutine_threadsafe(exchange(request), loop).result()
    try:
        return _time(round_trip, batch, count, warmup)
    finally:
        asyncio.run_coroutine_threadsafe(channel.close(), loop).result()
        loop.call_soon_threadsafe(loop.stop)


def _aio_inline(address, batch, count, warmup, options=()) -> list[float]:
    async def run():
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            call = channel.stream_stream(METHOD_STREAM, identity, identity)()
            request = _request(batch)
            times_us = []
            for i in range(warmup + count):
                start = time.perf_counter()
                await call.write(request)
                await call.read()
                if i >= warmup:
                    times_us.append((time.perf_counter() - start) * 1e6)
            await call.done_writing()
            return times_us
    return asyncio.run(run())


def _aio_inline_beside_a_server(address, batch, count, warmup, options=()) -> list[float]:
    """aio-inline while another thread's loop holds a grpc.aio server (as cpu_service's main loop does):
    grpc.aio has one completion-queue poller per process, and every loop bound to it is woken by it."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def idle_server():
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        return server

    def run_loop():
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(idle_server())
        loop.run_forever()
        loop.run_until_complete(server.stop(None))

    thread = threading.Thread(target=run_loop, daemon=True)
    thread.start()
    ready.wait()
    try:
        return _aio_inline(address, batch, count, warmup, options)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def measure(server_kind: str = "aio", batch_sizes=(8,), modes=MODES, count: int = 2000, warmup: int = 200,
            options: tuple[tuple[str, int], ...] = ()) -> dict:
    """options: gRPC channel arguments, given to the client's channel and to the server alike."""
    results: dict[str, dict] = {}
    serve_args = [f"--arg={name}={value}" for name, value in options]
    with served("bench.grpc_floor", server_kind, *serve_args) as address:
        for mode in modes:
            for batch in batch_sizes:
                if mode.startswith("aio"):
                    runner = {"aio-loop-thread": _aio_loop_thread, "aio-inline": _aio_inline,
                              "aio-inline-beside-server": _aio_inline_beside_a_server}[mode]
                    times_us = runner(address, batch, count, warmup, options)
                else:
                    with grpc.insecure_channel(address, options=options) as channel:
                        if mode == "unary":
                            call = channel.unary_unary(METHOD_UNARY, identity, identity)
                            times_us = _time(call, batch, count, warmup)
                        else:
                            times_us = _thread_stream(channel, batch, count, warmup, mode == "direct-stream")
                results.setdefault(mode, {})[str(batch)] = {
                    "p50_us": round(percentile(times_us, 50), 1), "p99_us": round(percentile(times_us, 99), 1)}
    return {"server": server_kind, "round_trips": count, "up_bytes_per_row": UP_BYTES_PER_ROW,
            "down_bytes_per_row": DOWN_BYTES_PER_ROW, "modes": results, "options": dict(options),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def _channel_arg(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    return name, int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="aio", choices=SERVERS)
    parser.add_argument("--batch", type=int, action="append", help="rows (repeatable; default 8)")
    parser.add_argument("--mode", choices=MODES, action="append", help="client mode (repeatable; default all)")
    parser.add_argument("--count", type=int, default=2000, help="timed round trips per point")
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=INT",
                        help="a gRPC channel argument for both ends, e.g. grpc.http2.bdp_probe=0 (repeatable)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    options = tuple(_channel_arg(text) for text in args.arg)
    if args.serve:
        _serve(args.serve, options)
        return 0
    result = measure(args.server, tuple(args.batch or (8,)), tuple(args.mode or MODES), max(args.count, 1),
                     options=options)
    for mode, by_batch in result["modes"].items():
        for batch, row in by_batch.items():
            print(f"{result['server']:>4} server {mode:>16} batch {batch:>3}: p50 {row['p50_us']:8.1f} µs"
                  f"  p99 {row['p99_us']:8.1f} µs")
    leave_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
