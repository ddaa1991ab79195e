"""CPU time per GB of one KV chunk's trip through the gRPC path's Python side, previous vs now.

    python -m bench.kv_chunk_cpu [--model M] [--context-tokens 1024] [--repeats 20]

Per chunk of the model's real layout (one layer, `--context-tokens` tokens, fp32), the source
side (gather from a KV pool, bytes, CRC, serialize) and the target side (parse, CRC, bytes ->
tensor, scatter into a pool), each timed with the thread's CPU clock (time.thread_time), which
a loaded machine's descheduling does not inflate. "previous" replays the path before issue 17
(numpy().tobytes(), protobuf message + SerializeToString, bytearray copy before frombuffer);
"now" is the code in use (tensor_buffer, wire.kv_chunk_wire's one-join encoding, frombuffer on
the received bytes). Sockets and gRPC's own framing are not in it (bench.kv_grpc has the whole
transfer). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dualpace.engine.transfer.kv_bytes import tensor_buffer, tensor_bytes, tensor_from_bytes
from dualpace.engine.transfer.kv_checksum import kv_checksum
from dualpace.engine.transfer.kv_transfer import KvChunk
from dualpace.model.loader import load_tokenizer_and_config
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.wire.engine_messages import kv_chunk_to_pb
from dualpace.wire.kv_chunk_wire import decode_kv_chunk_message, encode_kv_chunk_message


def previous_source(k: torch.Tensor, v: torch.Tensor) -> bytes:
    k_bytes, v_bytes = tensor_bytes(k), tensor_bytes(v)
    chunk = KvChunk(0, 1, 0, k.shape[0], k_bytes, v_bytes, kv_checksum(k_bytes, v_bytes))
    return kv_chunk_to_pb(chunk).SerializeToString()


def now_source(k: torch.Tensor, v: torch.Tensor) -> bytes:
    k_buffer, v_buffer = tensor_buffer(k), tensor_buffer(v)
    return encode_kv_chunk_message(KvChunk(0, 1, 0, k.shape[0], k_buffer, v_buffer, kv_checksum(k_buffer, v_buffer)))


def previous_target(data: bytes, shape) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = decode_kv_chunk_message(data)
    assert kv_checksum(chunk.k, chunk.v) == chunk.crc32
    return (torch.frombuffer(bytearray(chunk.k), dtype=torch.float32).view(shape),
            torch.frombuffer(bytearray(chunk.v), dtype=torch.float32).view(shape))


def now_target(data: bytes, shape) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = decode_kv_chunk_message(data)
    assert kv_checksum(chunk.k, chunk.v) == chunk.crc32
    return tensor_from_bytes(chunk.k, "float32", shape), tensor_from_bytes(chunk.v, "float32", shape)


def cpu_ms(function, repeats: int) -> float:
    """The least thread CPU time of `repeats` calls, in ms."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        function()
        best = min(best, time.thread_time() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_chunk_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    _, config = load_tokenizer_and_config(args.model)
    shape = (args.context_tokens, config.num_kv_heads, config.head_dim)
    num_slots = 2 * args.context_tokens
    pool_k, pool_v = torch.randn(num_slots, *shape[1:]), torch.randn(num_slots, *shape[1:])
    slots = torch.randperm(num_slots)[: args.context_tokens]  # scattered, as blocks are

    def gather():
        return pool_k.index_select(0, slots), pool_v.index_select(0, slots)

    def scatter(k, v):
        pool_k.index_copy_(0, slots, k)
        pool_v.index_copy_(0, slots, v)

    chunk_bytes = 2 * pool_k[0].numel() * 4 * args.context_tokens
    data = now_source(*gather())
    assert data == previous_source(*gather())  # the same message either way
    result = {"model": args.model, "context_tokens": args.context_tokens, "chunk_bytes": chunk_bytes}
    for name, source, target in (("previous", previous_source, previous_target), ("now", now_source, now_target)):
        source_ms = cpu_ms(lambda: source(*gather()), args.repeats)
        target_ms = cpu_ms(lambda: scatter(*target(data, shape)), args.repeats)
        result[f"{name}_source_cpu_ms_per_gb"] = source_ms * 1e9 / chunk_bytes
        result[f"{name}_target_cpu_ms_per_gb"] = target_ms * 1e9 / chunk_bytes
    copy_source = torch.randn(chunk_bytes // 4)
    copy_target = torch.empty_like(copy_source)
    result["memcpy_cpu_ms_per_gb"] = cpu_ms(lambda: copy_target.copy_(copy_source), args.repeats) * 1e9 / chunk_bytes
    result["load_avg_1m"] = os.getloadavg()[0]
    print(json.dumps({key: round(value, 2) if isinstance(value, float) else value for key, value in result.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
