"""A/B of the same-host KV transfer with and without progress reports, interleaved transfer by transfer.

On a shared machine the load moves between whole bench runs by more than the effect of the verify
overlapped with the copy (dualpace.engine.transfer.kv_shm_send.PROGRESS_GROUPS), so here one sender, one
target and one source pool time transfers of `--tokens` (default 1024, 23.6 MB of the default model's
bf16 KV) with the settings of `--groups` taking turns (0: no reports, the verify after the copy, as
before them; 6x1: six reported ranges copied by one thread, PROGRESS_WORKERS), with
bench.data_plane's target, timing and settle time.

    python -m bench.kv_shm_progress_ab --rounds 15 --groups 0,6x1,6x2,3x1

The last output line is one JSON object: per setting the median and quartiles of the transfer (ms),
its phases' medians (`SameHostKvSender.phase_ms`), and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from bench.data_plane import source_pool, transfer
from bench.kv_shm_fixed_cost import start_target
from dualpace.engine.transfer import kv_shm_send
from dualpace.engine.transfer.kv_shm_send import MappedPools
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.serve.kv_shm_transport import SameHostKvSender
from dualpace.serve.peer_channels import PeerChannels
from dualpace.wire.engine_messages import info_request_to_pb
from toolkit.engine_client import EngineClient


async def interleaved(address: str, storage, info, num_tokens: int, groups: list[int], rounds: int,
                      settle_s: float) -> dict[str, list[dict]]:
    """{setting: [phase_ms with "total_ms", ...]}: one warm-up transfer per setting, then `rounds` turns.
    A setting is "G" (PROGRESS_GROUPS) or "GxW" (and PROGRESS_WORKERS)."""
    channels = PeerChannels()
    sender = SameHostKvSender(address, MappedPools(), {}, channels)
    runs: dict[str, list[dict]] = {g: [] for g in groups}
    try:
        for i in range(rounds + 1):
            for g in groups:
                num_groups, _, num_workers = g.partition("x")
                kv_shm_send.PROGRESS_GROUPS = int(num_groups)
                kv_shm_send.PROGRESS_WORKERS = int(num_workers or kv_shm_send.KV_TRANSFER_WORKERS)
                header, chunks = transfer(storage, info, num_tokens)
                start = time.perf_counter()
                await sender(header, chunks)
                total_ms = (time.perf_counter() - start) * 1e3
                if not sender.used_shm:
                    raise SystemExit("the transfers fell back to gRPC (see the log): nothing to compare")
                if i > 0:
                    runs[g].append({**sender.phase_ms, "total_ms": total_ms})
                await asyncio.sleep(settle_s)  # the imported request decodes its one token and ends
        sender.pools.close()
    finally:
        await channels.close()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--groups", default="0,6x1,6x2",
                        help="settings taking turns: PROGRESS_GROUPS, or GROUPSxWORKERS (PROGRESS_WORKERS too)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--settle-s", type=float, default=0.3)
    args = parser.parse_args()
    groups = args.groups.split(",")
    load_before = os.getloadavg()
    target = start_target(args.model, [args.tokens], "progress-ab-target")
    try:
        info = EngineClient(target.address).stub.Info(info_request_to_pb(), timeout=10)
        storage = source_pool(info, args.tokens)
        runs = asyncio.run(interleaved(target.address, storage, info, args.tokens, groups, args.rounds,
                                       args.settle_s))
    finally:
        target.stop()
    result = {"tokens": args.tokens, "rounds": args.rounds, "load_average_before_after": [load_before, os.getloadavg()]}
    for g, phases in runs.items():
        totals = [p["total_ms"] for p in phases]
        result[f"groups_{g}"] = {
            "median_ms": round(statistics.median(totals), 3),
            "quartiles_ms": [round(q, 3) for q in statistics.quantiles(totals, n=4)],
            "phase_ms_median": {name: round(statistics.median(p[name] for p in phases if name in p), 3)
                                for name in phases[0]},
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
