"""CPU time of the Dense Assist shared-memory ring per layer, and of its pieces, in one process.

    python -m bench.assist_ring_cpu                 # batch 8, bf16, the default model's shapes
    python -m bench.assist_ring_cpu --batch 1 --repeats 5000

One process plays both ends of one segment (dualpace/engine/assist/shm_ring.py): the server side sends
a layer's q/k/v, the client side receives them and sends the attention output, the server side
receives it. No waiting is involved (each doorbell already reads what the receiver expects), so
`time.thread_time_ns` over many round trips is the work the transport itself costs on a core,
unlike bench/assist_rtt.py's wall-clock round trip, which on a busy host is mostly waiting for a
core. The pieces are timed the same way, each on its own, to show where a round trip goes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.assist_rtt import DTYPES, Shapes, cpu_model
from cpu_service.assist_shm import NUM_SLOTS, slot_bytes_for
from dualpace.engine.assist.assist_types import ShmSlotKind
from dualpace.engine.assist.shm_ring import ShmSegment
from dualpace.model.registry import DEFAULT_MODEL_NAME


def _cpu_us(repeats: int, step) -> float:
    step()
    started_ns = time.thread_time_ns()
    for _ in range(repeats):
        step()
    return (time.thread_time_ns() - started_ns) / repeats / 1e3


def measure(batch: int = 8, model: str = DEFAULT_MODEL_NAME, dtype: str = "bf16", repeats: int = 3000) -> dict:
    """CPU µs per ring round trip (both ends) and per piece, at this batch."""
    shapes = Shapes.of(model)
    torch_dtype = DTYPES[dtype]
    q, k, v = (torch.randn(batch, heads, shapes.head_dim).to(torch_dtype)
               for heads in (shapes.num_heads, shapes.num_kv_heads, shapes.num_kv_heads))
    output = torch.randn(batch, shapes.num_heads * shapes.head_dim).to(torch_dtype)
    client_segment = ShmSegment.create(NUM_SLOTS, slot_bytes_for(batch, shapes.num_heads, shapes.num_kv_heads,
                                                                 shapes.head_dim))
    server_segment = ShmSegment.open(client_segment.peer_path, client_segment.size_bytes, client_segment.client_token)
    client, server = client_segment.endpoint("up", 0.0), server_segment.endpoint("down", 0.0)

    def server_send():
        server.send_parts(ShmSlotKind.QKV, 1, 0, (q, k, v))

    def client_send():
        client.send_parts(ShmSlotKind.ATTENTION_OUTPUT, 1, 0, (output,))

    def round_trip():
        server_send()
        client.receive(None)
        client_send()
        server.receive(None)

    def down():
        server_send()
        client.receive(None)

    def up():
        client_send()
        server.receive(None)

    try:
        server_send()
        received_qkv = client.receive(None).tensors
        client_send()
        received_output = server.receive(None).tensors
        if not (all(map(torch.equal, received_qkv, (q, k, v))) and torch.equal(received_output[0], output)):
            raise RuntimeError("the ring did not carry the tensors unchanged: nothing measured")
        pieces = {"round_trip": _cpu_us(repeats, round_trip), "down_send_and_receive": _cpu_us(repeats, down),
                  "up_send_and_receive": _cpu_us(repeats, up)}
        pieces["qkv_send_alone"] = _cpu_us(repeats, server_send)
        pieces["output_send_alone"] = _cpu_us(repeats, client_send)
        pieces["doorbell_post"] = _cpu_us(repeats, lambda: server.outgoing.post(server.num_sent))
        pieces["python_sum_range_1000"] = _cpu_us(max(repeats // 10, 1), lambda: sum(range(1000)))  # a yardstick
    finally:
        client_segment.close()
        server_segment.close()
    return {"batch": batch, "model": model, "dtype": dtype, "cpu_us": {name: round(us, 2) for name, us in pieces.items()},
            "cpu": cpu_model(), "load_average_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.assist_ring_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="whose shapes (heads, head_dim)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3000, help="round trips (and piece calls) timed")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be >= 1")
    result = measure(args.batch, args.model, args.dtype, args.repeats)
    for name, us in result["cpu_us"].items():
        print(f"{name:>24} {us:8.2f} µs CPU")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
