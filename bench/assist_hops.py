"""Where a Dense Assist round trip over gRPC goes: per-hop time.monotonic_ns marks in both processes.

    python -m bench.assist_hops                     # batch 8, default model's shapes, 30 iterations
    python -m bench.assist_hops --batch 1 --iterations 50 --out hops.json
    python -m bench.assist_hops --stage-gaps        # the stage alone, back to back and after gaps

The same exchange as bench/assist_rtt.py over gRPC (the real AssistClient against the real
DenseAssist servicer with InstantSession stages), with marks taken by wrapping, not by editing,
the code on the path: the client stream's send, its request serializer (run by gRPC's consumer
thread) and its reply deserializer (run by the reading caller); on the server, the request
deserializer and the reply serializer (both on the event loop) and the stage (`_reply_to`). Both
processes read CLOCK_MONOTONIC, so a mark in one can be subtracted from a mark in the other. The
k-th message up is answered by the k-th message down, so marks pair by their order. Medians per
hop over every layer of the timed iterations (the wrappers add ~1 µs each):

    encode        attend returned -> the client's send (the output encoded)
    to_consumer   send -> gRPC's consumer thread serializes it (the request queue's thread hop)
    wire_up       consumer thread -> server loop deserializes it (C-core write, socket, server poller, loop)
    to_stage      deserialized -> the servicer's stage starts
    stage         decode, session, encode of q/k/v (inline on the loop or in the pool)
    to_serialize  stage done -> gRPC serializes the reply on the loop
    wire_down     server serializer -> the client's caller deserializes it (socket, client poller, caller)
    decode        deserialized -> attend called with the next layer's q/k/v
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import torch

from bench.assist_rtt import DTYPES, InstantExecutor, Shapes, cpu_model
from bench.floor_server import leave_result
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams
from dualpace.stats import percentile

HOPS = ("encode", "to_consumer", "wire_up", "to_stage", "stage", "to_serialize", "wire_down", "decode")


async def _serve(shapes: Shapes, dtype: torch.dtype) -> None:
    """The bench's server with marks: what it records goes to stdout as one JSON line at the end."""
    import grpc

    from dualpace.wire import assist_wire
    from gpu_service import assist_servicer
    from gpu_service.assist_limits import AssistLimits

    marks: dict[str, list[int]] = {"deserialized": [], "stage_start": [], "stage_end": [], "serialized": []}
    reply_to = assist_servicer._reply_to

    def deserialize(data: bytes):
        marks["deserialized"].append(time.monotonic_ns())
        return assist_wire.parse_up(data)

    def serialize(message) -> bytes:
        marks["serialized"].append(time.monotonic_ns())
        return assist_wire.serialize_down(message)

    def marked_reply_to(session, message, lock):
        marks["stage_start"].append(time.monotonic_ns())
        try:
            return reply_to(session, message, lock)
        finally:
            marks["stage_end"].append(time.monotonic_ns())

    assist_servicer._reply_to = marked_reply_to
    servicer = assist_servicer.DenseAssistServicer(InstantExecutor(shapes, dtype), AssistLimits())
    handlers = {"Assist": grpc.stream_stream_rpc_method_handler(
        servicer.Assist, request_deserializer=deserialize, response_serializer=serialize)}
    service = assist_wire.ASSIST_METHOD.split("/")[1]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "marks?" from the parent
    print(json.dumps(marks), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace=None)


def measure(batch: int = 8, model: str = DEFAULT_MODEL_NAME, dtype: str = "bf16",
            num_iterations: int = 30, num_warmup: int = 5) -> dict:
    from cpu_service import assist_client, assist_stream
    from dualpace.wire import assist_wire

    shapes = Shapes.of(model)
    process = subprocess.Popen([sys.executable, "-m", "bench.assist_hops", "--serve", "--model", model,
                                "--dtype", dtype], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    marks: dict[str, list[int]] = {name: [] for name in ("returned", "sent", "consumed", "received", "called")}
    original_send = assist_stream.AssistStream.send

    def send(self, message) -> None:
        marks["sent"].append(time.monotonic_ns())
        original_send(self, message)

    def serialize_up(message) -> bytes:
        marks["consumed"].append(time.monotonic_ns())
        return assist_wire.serialize_up(message)

    def deserialize_down(data: bytes):
        marks["received"].append(time.monotonic_ns())
        return assist_wire.parse_down(data)

    try:
        address = f"127.0.0.1:{process.stdout.readline().strip()}"
        assist_stream.AssistStream.send = send
        client = assist_client.AssistClient(address, iteration_timeout_s=60.0, transport="grpc")
        client._assist = client._channel.stream_stream(assist_wire.ASSIST_METHOD, request_serializer=serialize_up,
                                                       response_deserializer=deserialize_down)
        output = torch.zeros(batch, shapes.num_heads * shapes.head_dim, dtype=DTYPES[dtype])

        def attend(layer, q, k, v):
            marks["called"].append(time.monotonic_ns())
            marks["returned"].append(time.monotonic_ns())
            return output

        sampling = [(SamplingParams(), row) for row in range(batch)]
        timed: list[tuple[int, int]] = []  # (first, last) message index of each timed iteration's layer round trips
        for iteration in range(num_warmup + num_iterations):
            first = len(marks["sent"])
            client.run_iteration([1] * batch, [7] * batch, attend, sampling)
            if iteration >= num_warmup:
                timed.append((first, len(marks["sent"])))
        client.close()
        process.stdin.write("marks?\n")
        process.stdin.flush()
        server = json.loads(process.stdout.readline())
    finally:
        assist_stream.AssistStream.send = original_send
        process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
    return _hops(marks, server, timed, batch, shapes)


def _hops(client: dict[str, list[int]], server: dict[str, list[int]], timed, batch: int, shapes: Shapes) -> dict:
    """Per-hop medians (µs). Message k up (k = 0: the begin) is answered by message k down; a layer's
    round trip k (k >= 1) starts at the attend return before send k and ends at the attend call after
    receive k. Attend marks are per layer: call/return j belongs to message j + 1 of its iteration."""
    hops: dict[str, list[float]] = {name: [] for name in HOPS + ("total",)}
    num_out_of_order = 0
    for first, last in timed:  # last - first = num_layers + 1 (the begin, then one output per layer)
        layer_index = first - first // (shapes.num_layers + 1)  # the iteration's first attend mark
        for k in range(first + 1, last - 1):  # the last output is answered by the result, not a layer
            returned = client["returned"][layer_index]
            called = client["called"][layer_index + 1]
            points = (returned, client["sent"][k], client["consumed"][k], server["deserialized"][k],
                      server["stage_start"][k], server["stage_end"][k], server["serialized"][k],
                      client["received"][k], called)
            for name, start, end in zip(HOPS, points, points[1:]):
                hops[name].append((end - start) / 1e3)
                num_out_of_order += end < start  # a mark paired with another round trip's
            hops["total"].append((called - returned) / 1e3)
            layer_index += 1
    return {"batch": batch, "num_round_trips": len(hops["total"]), "cpu": cpu_model(),
            "hops_us_p50": {name: round(percentile(values, 50), 1) for name, values in hops.items()},
            "total_us_p99": round(percentile(hops["total"], 99), 1), "num_out_of_order": num_out_of_order,
            "load_average_1m": round(os.getloadavg()[0], 2)}


def stage_after_gaps(gaps_us=(0, 300, 2000), batch: int = 8, model: str = DEFAULT_MODEL_NAME, dtype: str = "bf16",
                     count: int = 2000) -> dict:
    """The servicer's inline stage (`_reply_to`: parse, InstantSession, encode of q/k/v) timed alone in
    this process, back to back and after each gap (sleeping, or busy in a Python loop): how much slower
    the same Python runs when something else ran, or nothing did, since its last call. p50 µs."""
    import threading

    from dualpace.engine.assist.assist_types import AssistBegin
    from dualpace.wire import assist_wire
    from gpu_service.assist_servicer import _reply_to

    shapes = Shapes.of(model)
    session = InstantExecutor(shapes, DTYPES[dtype]).new_session()
    session.begin(AssistBegin(iteration_id=1, token_ids=[1] * batch, positions=[7] * batch,
                              sampling=[(SamplingParams(), row) for row in range(batch)]))
    up = assist_wire.encode_attention_output_up(1, 0, torch.zeros(batch, shapes.num_heads * shapes.head_dim,
                                                                  dtype=DTYPES[dtype]))
    lock = threading.Lock()

    def busy(gap_s: float) -> None:
        end_s = time.perf_counter() + gap_s
        while time.perf_counter() < end_s:
            pass

    results: dict[str, float] = {}
    for how, wait in (("sleep", time.sleep), ("busy", busy)):
        for gap_us in gaps_us:
            if how == "busy" and not gap_us:
                continue
            times_us = []
            for _ in range(count):
                if gap_us:
                    wait(gap_us / 1e6)
                session._next_layer = 0  # the same layer's stage again
                times_us.append(_reply_to(session, assist_wire.parse_up(up), lock)[1] * 1e6)
            results[f"{how}_{gap_us}us"] = round(percentile(times_us, 50), 1)
    return {"batch": batch, "stage_us_p50_after_gap": results, "cpu": cpu_model(),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.assist_hops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--stage-gaps", action="store_true",
                        help="instead: the inline stage alone, back to back and after sleeping/busy gaps")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(Shapes.of(args.model), DTYPES[args.dtype]))
        return 0
    if args.stage_gaps:
        result = stage_after_gaps(batch=args.batch, model=args.model, dtype=args.dtype)
        print(json.dumps(result))
        return 0
    result = measure(args.batch, args.model, args.dtype, args.iterations)
    print("  ".join(f"{name} {value}" for name, value in result["hops_us_p50"].items()),
          f"(µs p50; total p99 {result['total_us_p99']}; load {result['load_average_1m']})")
    leave_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
