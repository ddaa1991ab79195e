"""Where the time of a same-host KV transfer goes, on both sides, on one clock.

The sender (this process, SameHostKvSender.marks) and the target (a real cpu_service, whose
ImportKv debug line "kv import" carries its marks) stamp their events with time.perf_counter,
which on Linux is CLOCK_MONOTONIC, one clock for every process of the host. So the two sides'
events merge into one timeline per transfer; printed is, per size, each event in order with the
median time since the sender's start (over the repeats) and the gap since the event
before it, ms.

    python -m bench.kv_shm_timeline --sizes 16,1024 --repeats 9

The last output line is one JSON object: {num_tokens: [[event, median ms, gap ms], ...]}, the
moment each transfer's copy ended, and the
load average before and after. The target logs at DEBUG for this, which costs it a little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics

from bench.data_plane import source_pool, transfer
from bench.kv_shm_fixed_cost import start_target
from dualpace.engine.transfer.kv_shm_send import MappedPools
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.serve.kv_shm_transport import SameHostKvSender
from dualpace.serve.peer_channels import PeerChannels
from dualpace.wire.engine_messages import info_request_to_pb
from toolkit.engine_client import EngineClient


def target_marks(output_lines, seen: set[str]) -> list[tuple[str, float]] | None:
    """The marks of the newest "kv import" line of the target not read before."""
    for line in reversed(list(output_lines)):
        if '"kv import"' not in line or line in seen:
            continue
        seen.add(line)
        return [(name, float(t)) for name, t in json.loads(line)["marks_s"]]
    return None


def merged_offsets(sender_marks, target_marks_) -> dict[str, float]:
    """{side:event: ms since the sender's start}, both sides on the one clock."""
    start = sender_marks[0][1]
    events = [(f"S:{n}", t) for n, t in sender_marks] + [(f"T:{n}", t) for n, t in target_marks_]
    return {name: (t - start) * 1e3 for name, t in events}


def median_timeline(runs: list[dict[str, float]]) -> list[list]:
    """[[event, median ms since start, gap ms since the event before]] in the order of those medians."""
    medians = sorted((statistics.median(run[name] for run in runs if name in run), name) for name in runs[0])
    return [[name, round(t, 3), round(t - (medians[i - 1][0] if i else 0.0), 3)]
            for i, (t, name) in enumerate(medians)]


async def timelines(address: str, storage, info, target, sizes, repeats: int, settle_s: float) -> dict:
    channels = PeerChannels()
    sender = SameHostKvSender(address, MappedPools(), {}, channels)
    seen: set[str] = set()
    out = {}
    try:
        for num_tokens in sizes:
            runs = []
            for i in range(repeats + 1):
                header, chunks = transfer(storage, info, num_tokens)
                await sender(header, chunks)
                await asyncio.sleep(settle_s)  # the imported request decodes its one token and ends
                theirs = target_marks(target.output, seen)
                if i > 0 and theirs is not None and sender.used_shm:
                    runs.append(merged_offsets(sender.marks, theirs))
            out[str(num_tokens)] = median_timeline(runs)
            out[f"{num_tokens}_copied_at_ms_each"] = [round(run["S:copied"], 2) for run in runs]
    finally:
        sender.pools.close()
        await channels.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--sizes", default="16,1024")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--settle-s", type=float, default=0.3)
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    load_before = os.getloadavg()
    target = start_target(args.model, sizes, "timeline-target", "--log-level", "DEBUG")
    try:
        info = EngineClient(target.address).stub.Info(info_request_to_pb(), timeout=10)
        storage = source_pool(info, max(sizes))
        result = asyncio.run(timelines(target.address, storage, info, target, sizes, args.repeats, args.settle_s))
    finally:
        target.stop()
    for num_tokens in sizes:
        print(f"{num_tokens} tokens, median ms since the sender's start (gap since the event before):")
        for name, at_ms, gap_ms in result[str(num_tokens)]:
            print(f"  {at_ms:8.3f} ({gap_ms:+7.3f})  {name}")
    result["load_average_before_after"] = [load_before, os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
