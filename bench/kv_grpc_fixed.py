"""KV over gRPC alone, as bench/data_plane.py times it: fixed cost and rate of GrpcKvSender transfers.

    python -m bench.kv_grpc_fixed [--sizes 1,64,256,1024] [--repeats 5] [--channels kept|fresh] [--out F.json]

The gRPC half of bench/data_plane.py without the shared-memory and assist parts (same source
pool, same transfers, same header-to-commit timing into a cpu_service target, same fit), so an
A/B of the gRPC path takes a minute, not several: run it with PYTHONPATH at each tree. Also a
1-token transfer: the default model's 30 one-layer chunks of one token each, the floor of the
fixed cost. --channels kept (the default) sends every transfer on one channel kept open, as an engine
daemon does since session 9 (dualpace.serve.peer_channels); fresh opens and closes a channel per
transfer, as daemons did before. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics

from bench.data_plane import source_pool, summarize, time_transfers
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.serve.kv_transport import GrpcKvSender
from dualpace.serve.peer_channels import PeerChannels
from dualpace.wire.engine_messages import info_request_to_pb
from toolkit.engine_client import EngineClient
from toolkit.processes import start_daemon


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_grpc_fixed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--sizes", default="1,64,256,1024", help="token counts timed (the fit leaves out 1)")
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settle-s", type=float, default=0.3)
    parser.add_argument("--channels", choices=("kept", "fresh"), default="kept",
                        help="one channel kept across the transfers (as a daemon does), or one per transfer")
    parser.add_argument("--label", default="", help="names the tree or variant in the output")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = sorted({int(size) for size in args.sizes.split(",")} | {args.context_tokens})
    target = start_daemon("cpu_service", "--model", args.model, "--dtype", "auto", "--threads", "1",
                          "--name", "kv-grpc-target", "--kv-blocks", str(4 * (max(sizes) // 16 + 2)),
                          "--block-size", "16", "--assist", "never", "--log-level", "WARNING")
    try:
        info = EngineClient(target.address).stub.Info(info_request_to_pb(), timeout=10)
        storage = source_pool(info, max(sizes))
        bytes_per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim * storage.k.element_size()
        times = asyncio.run(timed(target.address, args.channels == "kept", storage, info, sizes, args))
    finally:
        target.stop()
    summary = summarize({n: ms for n, ms in times.items() if n > 1}, bytes_per_token, args.context_tokens)
    result = {"label": args.label, "channels": args.channels, "model": args.model, "load_average_1m": round(os.getloadavg()[0], 2),
              "kv_grpc_fit_gbps": round(summary["fit_gbps"], 3), "kv_grpc_fixed_ms": round(summary["fixed_ms"], 2),
              "kv_grpc_gbps": round(summary["gbps_at_context"], 3), "context_tokens": args.context_tokens,
              "median_ms_by_tokens": {str(n): round(statistics.median(ms), 2) for n, ms in times.items()}}
    line = json.dumps(result)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as out:  # appends: one line per run of an A/B
            out.write(line + "\n")
    print(line)
    return 0


async def timed(address: str, kept: bool, storage, info, sizes, args) -> dict[int, list[float]]:
    channels = PeerChannels() if kept else None
    try:
        times, _ = await time_transfers(lambda: GrpcKvSender(address, channels=channels), storage, info, sizes,
                                        args.repeats, args.settle_s)
    finally:
        if channels is not None:
            await channels.close()
    return times


if __name__ == "__main__":
    raise SystemExit(main())
