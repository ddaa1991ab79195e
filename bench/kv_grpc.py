"""KV transfer over gRPC (the cross-host path) beside memcpy and the checksum, in one run.

    python -m bench.kv_grpc [--model M] [--dtype auto] [--context-tokens 1024] [--repeats 3] [--out F.json]

A source EngineLoop in this process holds a request of `--context-tokens` prompt tokens
(prefilled here, one token decoded) and moves it with the real `migrate_out` and
`GrpcKvSender` into a real gpu_service daemon on 127.0.0.1 (ImportKv through commit); the
target aborts the imported request at once. The rate is KV bytes over the move's duration
(pause to release, MigrationStats); the fixed cost is the duration of a 1-token move. In the
same run: memcpy GB/s (torch copy) and the checksum's GB/s (CRC32C, and zlib's CRC32 for
comparison), over a buffer as large as the transfer and over one chunk's size. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import zlib

import torch

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.transfer.kv_checksum import CHECKSUM_NAME, is_hardware_accelerated, kv_checksum
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.migration import migrate_out
from dualpace.model.loader import load_model
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams
from dualpace.serve.kv_transport import GrpcKvSender
from toolkit.engine_client import EngineClient
from toolkit.processes import start_daemon

BLOCK_SIZE = 16
BEST_OF = 8


def best_gbps(function, num_bytes: int, repeats: int = BEST_OF) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def memcpy_gbps(num_bytes: int) -> float:
    source = torch.ones(num_bytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    return best_gbps(lambda: target.copy_(source), num_bytes)


def checksum_gbps(num_bytes: int, suffix: str = "") -> dict[str, float]:
    k, v = os.urandom(num_bytes // 2), os.urandom(num_bytes // 2)
    return {
        f"{CHECKSUM_NAME}{suffix}_gbps": best_gbps(lambda: kv_checksum(k, v), num_bytes),
        f"zlib_crc32{suffix}_gbps": best_gbps(lambda: zlib.crc32(v, zlib.crc32(k)), num_bytes),
    }


class TimedSender:
    """GrpcKvSender, timed from the header to the commit (without the waits for step boundaries)."""

    def __init__(self, target_address: str):
        self.sender = GrpcKvSender(target_address)
        self.send_ms = 0.0

    async def __call__(self, header, chunks) -> str:
        start = time.perf_counter()
        try:
            return await self.sender(header, chunks)
        finally:
            self.send_ms = (time.perf_counter() - start) * 1e3


async def move_once(loop: EngineLoop, target_address: str, request_id: str, num_tokens: int, vocab_size: int):
    prompt = [1 + (7 * i) % (vocab_size - 1) for i in range(num_tokens)]
    channel = await loop.add_request(request_id, prompt, SamplingParams(max_tokens=1024, ignore_eos=True))
    async for _ in channel.follow():  # prefilled and decoding
        break
    sender = TimedSender(target_address)
    stats = await migrate_out(loop, request_id, sender, migrated_to=target_address)
    stats = (stats, sender.send_ms)
    target = EngineClient(target_address)
    try:
        target.abort(request_id, timeout_s=30)
    finally:
        target.close()
    return stats


async def measure_moves(loaded, target_address: str, context_tokens: int, repeats: int) -> dict:
    num_blocks = 2 * (context_tokens + 64) // BLOCK_SIZE + 8
    loop = EngineLoop(EngineCore(loaded, EngineConfig(name="bench-src", num_kv_blocks=num_blocks,
                                                      block_size=BLOCK_SIZE, prefix_caching=False)))
    task = asyncio.create_task(loop.run())
    vocab_size = loaded.config.vocab_size
    try:
        await move_once(loop, target_address, "warm-up", context_tokens, vocab_size)
        moves = [await move_once(loop, target_address, f"kv-{i}", context_tokens, vocab_size) for i in range(repeats)]
        fixed = [await move_once(loop, target_address, f"fixed-{i}", 1, vocab_size) for i in range(repeats)]
    finally:
        loop.stop()
        await task
        loop.close()
    best, send_ms = min(moves, key=lambda move: move[1])
    return {
        "kv_grpc_gbps": best.total_bytes / (send_ms / 1e3) / 1e9,  # header to commit
        "kv_grpc_ms": send_ms,
        "kv_move_ms": min(stats.duration_ms for stats, _ in moves),  # pause to release
        "kv_bytes": best.total_bytes,
        "kv_chunks": best.num_chunks,
        "kv_fixed_ms": min(ms for _, ms in fixed),  # a 1-token move, header to commit
        "kv_fixed_move_ms": min(stats.duration_ms for stats, _ in fixed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_grpc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in the target daemon")
    parser.add_argument("--out", default=None, help="also write the result JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype)
    target = start_daemon("gpu_service", "--model", args.model, "--dtype", args.dtype, "--device", "cpu",
                          "--threads", str(args.threads), "--block-size", str(BLOCK_SIZE),
                          "--kv-blocks", str(2 * (args.context_tokens + 64) // BLOCK_SIZE + 8),
                          "--log-level", "WARNING")
    try:
        moves = asyncio.run(measure_moves(loaded, target.address, args.context_tokens, args.repeats))
    finally:
        target.stop()
    result = {
        "model": args.model, "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "context_tokens": args.context_tokens,
        # Over a buffer as large as the whole transfer (from memory), and over one chunk's size
        # (a chunk is checksummed right after it is gathered, so mostly from cache).
        "memcpy_gbps": memcpy_gbps(moves["kv_bytes"]),
        **checksum_gbps(moves["kv_bytes"]),
        "memcpy_chunk_gbps": memcpy_gbps(moves["kv_bytes"] // moves["kv_chunks"]),
        **checksum_gbps(moves["kv_bytes"] // moves["kv_chunks"], "_chunk"),
        "checksum_hardware": is_hardware_accelerated(),
        **moves,
        "load_avg_1m": os.getloadavg()[0],
    }
    result["kv_grpc_fraction_of_memcpy"] = result["kv_grpc_gbps"] / result["memcpy_gbps"]
    line = json.dumps({key: round(value, 4) if isinstance(value, float) else value for key, value in result.items()})
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
