"""Data plane: KV transfer over shared memory and the TCP data socket, beside memcpy in the same run.

A real cpu_service with the model (default: the default model) is the target. This process
plays the source: a KV pool of that model's shape filled with random values, sent through the
engines' own senders (SameHostKvSender for shm, TcpKvSender for the cross-host data socket over
loopback) from header to commit,
so the target reserves, checks and commits each transfer as a migration would (the imported
request then decodes one token there and ends). Sizes are token counts; each transport's rate
and fixed cost come from a least-squares fit of ms = fixed + bytes / rate over them, and the
time at `--context-tokens` (1024) is reported as measured. The shm path's fixed cost is also measured:
the median of `--fixed-repeats` (15) transfers of `--fixed-tokens` (16), kv_shm_fixed_ms_measured.
Two copy references, both at the context size:
- memcpy_gbps: torch's copy of a private buffer of the transfer's size into another, back to back
  (warm: what the caches hold is the buffer just copied), before and after the transfers.
- memcpy_cold_gbps: a plain one-thread copy (ctypes.memmove, one call per layer for K and one for
  V) of the SAME source runs the transfer sends, from the bench's source pool into a memfd mapping
  of the target pool's size faulted in by the pools' own populate(), each copy after the same
  `--settle-s` of sleep the transfers see, right after the shm transfers (same run, same minute).
  The transfer's source is as cold as this one's; kv_shm_fraction_of_cold_memcpy =
  kv_shm_gbps / memcpy_cold_gbps is the like-for-like ratio, kv_shm_gbps / memcpy_gbps is not.
A shm transfer is copied by one thread (on the event loop up to shm_kv_copy.INLINE_MAX_BYTES, else
in a kv-export worker); kv_shm_breakdown_at_context times that copy alone, in this process.
All rates count bytes the same way: payload bytes, once (memcpy = bytes copied / copy time, not
read + written bytes; kv_*_gbps = K + V bytes of the transfer / its time, header to commit).

    python -m bench.data_plane --out bench/results/data_plane.json

The second-to-last line says the primary figures in words; the last is one JSON object, the primary
figures first (kv_shm_fraction_of_cold_memcpy, kv_shm_fraction_of_memcpy, kv_shm_fixed_ms_measured),
then memcpy_gbps, memcpy_cold_gbps, kv_shm_gbps, kv_tcp_gbps, kv_tcp_fixed_ms,
kv_tcp_fraction_of_memcpy, kv_fixed_ms (the fit's),
kv_shm_fit_fraction_of_memcpy (the fitted rate over the warm memcpy; _cold_ beside it),
assist_rtt_us_p50_shm, assist_rtt_us_p50_tcp, ...).
The Dense Assist round trips per layer come from bench.assist_rtt.measure (shm and the TCP data
socket, batch 1/8/32).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import json
import mmap
import os
import platform
import statistics
import time

import torch

from bench.kv_timeline import format_timeline
from dualpace.engine.transfer import kv_copy_native
from dualpace.engine.transfer.kv_bytes import DTYPES_BY_NAME, tensor_bytes
from dualpace.engine.transfer.kv_shm_send import MappedPools
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvLayout, KvTransferHeader
from dualpace.engine.transfer.shm_kv_copy import copy_in_place, slot_runs
from dualpace.engine.transfer.shm_populate import populate
from dualpace.kv.storage import KVStorage
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams
from dualpace.serve.kv_shm_transport import SameHostKvSender
from dualpace.serve.kv_tcp_transport import TcpKvSender
from dualpace.serve.peer_channels import PeerChannels
from dualpace.wire.engine_messages import info_request_to_pb
from profiles.profiler.measure import fit_transfer
from toolkit.engine_client import EngineClient
from toolkit.processes import start_daemon

_ids = itertools.count()


def cpu_kind() -> str:
    flags = set()
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags.update(f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx", "avx2")))
                break
    return ", ".join(sorted(flags)) or platform.processor() or "unknown"


def memcpy_gbps(num_bytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def shm_mapping(num_bytes: int) -> mmap.mmap:
    """A memfd mapping of `num_bytes`, its pages faulted in (and waited for) by the pools' populate()."""
    fd = os.memfd_create("data-plane-memcpy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, num_bytes)
        buffer = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    thread = populate(buffer, "the cold memcpy's target")
    if thread is not None:
        thread.join()
    return buffer


def memcpy_cold(storage: KVStorage, target_blocks: int, num_tokens: int, repeats: int, idle_s: float) -> dict:
    """One thread's ctypes.memmove of the transfer's source runs (slots 0..num_tokens-1 of each layer's
    K and V in `storage`) into a shm mapping of a `target_blocks` pool, each copy after `idle_s` of
    sleep; one untimed copy first. The copied bytes are checked against the source after the last."""
    slot_bytes = storage.num_kv_heads * storage.head_dim * storage.k.element_size()
    run_bytes, layer_bytes = num_tokens * slot_bytes, target_blocks * storage.block_size * slot_bytes
    if num_tokens > storage.num_blocks * storage.block_size or num_tokens > target_blocks * storage.block_size:
        raise ValueError(f"{num_tokens} tokens do not fit the source or the target pool")
    pool_bytes = storage.num_layers * layer_bytes
    buffer = shm_mapping(2 * pool_bytes)
    view = ctypes.c_char.from_buffer(buffer)
    base = ctypes.addressof(view)
    pairs = [(base + side * pool_bytes + layer * layer_bytes, source[layer].data_ptr())
             for side, source in enumerate((storage.k, storage.v)) for layer in range(storage.num_layers)]
    times = []
    try:
        for i in range(repeats + 1):
            if i:
                time.sleep(idle_s)
            start = time.perf_counter()
            for dst, src in pairs:
                ctypes.memmove(dst, src, run_bytes)
            if i:
                times.append(time.perf_counter() - start)
        sources = [pool[layer] for pool in (storage.k, storage.v) for layer in range(storage.num_layers)]
        for (dst, _), source in zip(pairs, sources):
            if ctypes.string_at(dst, run_bytes) != tensor_bytes(source.reshape(-1)[:run_bytes // source.element_size()]):
                raise RuntimeError("the cold memcpy's target does not hold the source bytes")
    finally:
        del view
        buffer.close()
    seconds = statistics.median(times)
    return {"gbps": 2 * storage.num_layers * run_bytes / seconds / 1e9, "ms": seconds * 1e3,
            "ms_all": [round(t * 1e3, 3) for t in times], "idle_s": idle_s}


def source_pool(info, num_tokens: int) -> KVStorage:
    """A private KV pool of the target model's shape holding `num_tokens` tokens of random KV."""
    dtype = DTYPES_BY_NAME[info.dtype.removeprefix("torch.")]
    block_size = info.block_size
    num_blocks = -(-num_tokens // block_size)
    storage = KVStorage(info.num_layers, num_blocks, block_size, info.num_kv_heads, info.head_dim, dtype)
    storage.k.copy_(torch.randn(storage.k.shape))
    storage.v.copy_(torch.randn(storage.v.shape))
    return storage


def transfer(storage: KVStorage, info, num_tokens: int) -> tuple[KvTransferHeader, OutgoingKv]:
    layout = KvLayout(storage.num_layers, storage.num_kv_heads, storage.head_dim, storage.block_size,
                      info.dtype.removeprefix("torch."))
    header = KvTransferHeader(
        request_id=f"data-plane-{num_tokens}-{next(_ids)}",
        prompt_token_ids=tuple(1 + i % (info.vocab_size - 1) for i in range(num_tokens)),
        output_token_ids=(1,), params=SamplingParams(max_tokens=2, seed=0, ignore_eos=True),
        num_computed_tokens=num_tokens, layout=layout,
        total_bytes=2 * layout.num_layers * num_tokens * layout.bytes_per_token_per_layer, source_engine="bench")
    return header, OutgoingKv(storage, list(range(num_tokens)))


async def time_transfers(sender, storage, info, sizes, repeats: int, settle_s: float):
    """{num_tokens: [ms, ...]} for header-to-commit transfers, after one untimed warm-up per size."""
    results = {}
    if not hasattr(sender, "phases_by_tokens"):
        sender.phases_by_tokens = {}  # SameHostKvSender: {num_tokens: [phase_ms, ...]}
        sender.last_marks_by_tokens = {}  # {num_tokens: the last timed transfer's marks} (--timeline)
    for num_tokens in sizes:
        times = []
        for i in range(repeats + 1):
            header, outgoing = transfer(storage, info, num_tokens)
            start = time.perf_counter()
            await sender(header, outgoing)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if i > 0:
                times.append(elapsed_ms)
                sender.num_timed = getattr(sender, "num_timed", 0) + 1
                sender.num_reserved_ahead = (getattr(sender, "num_reserved_ahead", 0)
                                             + bool(getattr(sender, "used_reserved_ahead", False)))
                if getattr(sender, "phase_ms", None):
                    sender.phases_by_tokens.setdefault(num_tokens, []).append(dict(sender.phase_ms))
                    sender.last_marks_by_tokens[num_tokens] = list(getattr(sender, "marks", ()))
            await asyncio.sleep(settle_s)  # the imported request decodes its one token and ends
        results[num_tokens] = times
    return results, sender


async def time_shm_transfers(address: str, storage, info, sizes, repeats: int, settle_s: float,
                             fixed_tokens: int, fixed_repeats: int):
    """time_transfers through one SameHostKvSender, its channel kept open across them as an engine keeps
    it: `sizes` `repeats` times each, then `fixed_tokens` `fixed_repeats` times (the fixed cost, as
    measured). Exits when a transfer fell back to gRPC (nothing to report for shm)."""
    channels = PeerChannels()
    try:
        sender = SameHostKvSender(address, MappedPools(), {}, channels)
        times, _ = await time_transfers(sender, storage, info, sizes, repeats, settle_s)
        fixed, _ = await time_transfers(sender, storage, info, [fixed_tokens], fixed_repeats, settle_s)
        if not sender.used_shm:
            raise SystemExit("the shm transfers fell back to gRPC (see the log): nothing to report for shm")
        sender.pools.close()
    finally:
        await channels.close()
    return times, fixed[fixed_tokens], sender


def phase_medians(sender) -> dict:
    """{num_tokens: {phase: median ms}} of a SameHostKvSender timed by time_transfers."""
    return {str(n): {name: round(statistics.median([p[name] for p in runs if name in p]), 3) for name in runs[0]}
            for n, runs in sender.phases_by_tokens.items()}


def summarize(results: dict[int, list[float]], bytes_per_token: int, context_tokens: int) -> dict:
    points = [(n * bytes_per_token, statistics.median(ms)) for n, ms in results.items()]
    rate, fixed_ms = fit_transfer(points)
    at_context = statistics.median(results[context_tokens])
    return {"fit_gbps": rate / 1e9, "fixed_ms": fixed_ms, "ms_at_context": at_context,
            "gbps_at_context": context_tokens * bytes_per_token / at_context / 1e6,
            "median_ms_by_tokens": {str(n): round(statistics.median(ms), 3) for n, ms in results.items()}}


def shm_breakdown(storage: KVStorage, num_tokens: int, repeats: int) -> dict:
    """The shm path's one pass over the bytes on its own, in this process, into a private pool: the
    sender's copy (each word CRC'd as it is stored), in one thread as a transfer runs it."""
    target = KVStorage(storage.num_layers, storage.num_blocks, storage.block_size, storage.num_kv_heads,
                       storage.head_dim, storage.dtype)
    slots = list(range(num_tokens))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy_in_place(storage.k, storage.v, target.k, target.v, slot_runs(slots, slots))
        times.append((time.perf_counter() - start) * 1e3)
    return {"sender_copy_and_checksum_ms": statistics.median(times)}


def assist_round_trips(model: str, num_iterations: int) -> dict:
    """Dense Assist round trip per layer (bench.assist_rtt: real client, real servicer answering at
    once) over shm and over the TCP data socket (as across hosts) at batch 1, 8, 32; the
    summary keys are batch 8's p50."""
    from bench.assist_rtt import measure

    by_transport = {transport: measure(transport, batch_sizes=(1, 8, 32), model=model, num_iterations=num_iterations)
                    for transport in ("shm", "tcp")}
    summary = {f"assist_rtt_us_p50_{t}": r["batch"]["8"]["p50_us"] for t, r in by_transport.items()}
    summary.update({f"assist_rtt_us_p99_{t}": r["batch"]["8"]["p99_us"] for t, r in by_transport.items()})
    return {**summary, "assist_rtt": {t: r["batch"] for t, r in by_transport.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--sizes", default="64,256,1024,2048", help="token counts of the transfers timed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fixed-tokens", type=int, default=16, help="the small transfer whose time is the fixed cost")
    parser.add_argument("--fixed-repeats", type=int, default=15, help="its timed repeats (the median is reported)")
    parser.add_argument("--settle-s", type=float, default=0.3)
    parser.add_argument("--assist-iterations", type=int, default=30, help="assisted iterations timed per batch size")
    parser.add_argument("--out", default=None, help="write the result JSON here too")
    parser.add_argument("--timeline", action="store_true",
                        help="print where the time of one shm transfer went, at the context and fixed sizes")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")} | {args.context_tokens})
    max_tokens = max(*sizes, args.fixed_tokens)
    target_blocks = 4 * (max_tokens // 16 + 2)
    target = start_daemon("cpu_service", "--model", args.model, "--dtype", args.dtype, "--threads", "1",
                          "--name", "data-plane-target", "--kv-blocks", str(target_blocks),
                          "--block-size", "16", "--assist", "never")
    try:
        client = EngineClient(target.address)
        info = client.stub.Info(info_request_to_pb(), timeout=10)
        storage = source_pool(info, max_tokens)
        bytes_per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim * storage.k.element_size()
        context_bytes = args.context_tokens * bytes_per_token
        memcpy = memcpy_gbps(context_bytes, max(5, args.repeats))

        async def run():
            shm, shm_fixed, shm_sender = await time_shm_transfers(target.address, storage, info, sizes, args.repeats,
                                                                  args.settle_s, args.fixed_tokens, args.fixed_repeats)
            cold = memcpy_cold(storage, target_blocks, args.context_tokens, max(5, args.repeats), args.settle_s)
            # Twice the repeats of the other paths: the socket's times vary more on a busy host.
            channels = PeerChannels()  # kept open across transfers, as an engine keeps its peers'
            try:
                tcp, tcp_sender = await time_transfers(TcpKvSender(target.address, channels=channels),
                                                       storage, info, sizes, 2 * args.repeats, args.settle_s)
            finally:
                await channels.close()
            control = "watch" if getattr(shm_sender, "used_watch_control", False) else "grpc"
            reserved_ahead = f"{getattr(shm_sender, 'num_reserved_ahead', 0)} of {getattr(shm_sender, 'num_timed', 0)}"
            if args.timeline:
                for num_tokens in (args.context_tokens, args.fixed_tokens):
                    print(format_timeline(f"shm transfer of {num_tokens} tokens (the last timed one):",
                                          shm_sender.last_marks_by_tokens[num_tokens]))
            return (shm, shm_fixed, cold, phase_medians(shm_sender), control, reserved_ahead, tcp,
                    phase_medians(tcp_sender))

        shm, shm_fixed, cold, shm_phases, shm_control, shm_reserved_ahead, tcp_times, tcp_phases = asyncio.run(run())
        memcpy_after = memcpy_gbps(context_bytes, max(5, args.repeats))
    finally:
        target.stop()
    shm_summary = summarize(shm, bytes_per_token, args.context_tokens)
    tcp_summary = summarize(tcp_times, bytes_per_token, args.context_tokens)
    warm_gbps = statistics.mean([memcpy, memcpy_after])
    primary = {  # the figures: the transfer against the cold copy of the same bytes, then the rest
        "kv_shm_fraction_of_cold_memcpy": round(shm_summary["gbps_at_context"] / cold["gbps"], 3),
        "kv_shm_fraction_of_memcpy": round(shm_summary["gbps_at_context"] / warm_gbps, 3),
        "kv_shm_fixed_ms_measured": round(statistics.median(shm_fixed), 3),
        "kv_shm_fixed_tokens": args.fixed_tokens, "kv_shm_fixed_ms_all": [round(t, 3) for t in shm_fixed],
    }
    breakdown = shm_breakdown(storage, args.context_tokens, args.repeats)
    result = {
        **primary,
        "memcpy_gbps": round(statistics.mean([memcpy, memcpy_after]), 3),
        "memcpy_gbps_before_after": [round(memcpy, 3), round(memcpy_after, 3)],
        "memcpy_cold_gbps": round(cold["gbps"], 3),  # same source runs, shm target, after the settle gap
        "memcpy_cold": cold,
        "kv_shm_gbps": round(shm_summary["gbps_at_context"], 3),
        "kv_fixed_ms": round(shm_summary["fixed_ms"], 3),
        "kv_shm_fit_gbps": round(shm_summary["fit_gbps"], 3),
        # The fitted (marginal) rate against both copy references: the bandwidth criterion, the
        # fixed cost (kv_fixed_ms) being counted apart.
        "kv_shm_fit_fraction_of_memcpy": round(shm_summary["fit_gbps"] / statistics.mean([memcpy, memcpy_after]), 3),
        "kv_shm_fit_fraction_of_cold_memcpy": round(shm_summary["fit_gbps"] / cold["gbps"], 3),
        "kv_tcp_gbps": round(tcp_summary["gbps_at_context"], 3),  # the cross-host data socket, over loopback
        "kv_tcp_fixed_ms": round(tcp_summary["fixed_ms"], 3),
        "kv_tcp_fit_gbps": round(tcp_summary["fit_gbps"], 3),
        "kv_tcp_fraction_of_memcpy": round(tcp_summary["gbps_at_context"] / statistics.mean([memcpy, memcpy_after]), 3),
        "kv_tcp_phase_ms_median": tcp_phases,
        "kv_shm": shm_summary, "kv_tcp": tcp_summary,
        "kv_shm_breakdown_at_context": breakdown,
        "kv_shm_phase_ms_median": shm_phases,
        "kv_shm_control": shm_control,  # where the timed shm transfers' messages went (after the first: the watch)
        "kv_shm_reserved_ahead": shm_reserved_ahead,  # of the timed shm transfers, those into blocks reserved ahead
        "kv_crc_path": kv_copy_native.crc_path(),  # the CRC loop of the fused copy (this process)
        "context_tokens": args.context_tokens, "context_bytes": context_bytes,
        "model": os.path.basename(args.model), "dtype": info.dtype, "cpu_kind": cpu_kind(),
        "load_average": os.getloadavg(),
        **assist_round_trips(args.model, args.assist_iterations),
    }
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            out.write(json.dumps(result, indent=2) + "\n")
    print(f"shm, {args.context_tokens} tokens: {result['kv_shm_gbps']} GB/s = "
          f"{100 * primary['kv_shm_fraction_of_cold_memcpy']:.0f}% of the cold one-thread copy "
          f"({result['memcpy_cold_gbps']} GB/s), {100 * primary['kv_shm_fraction_of_memcpy']:.0f}% of the warm memcpy "
          f"({result['memcpy_gbps']} GB/s); fixed cost at {args.fixed_tokens} tokens: "
          f"{primary['kv_shm_fixed_ms_measured']} ms (median of {args.fixed_repeats})")
    print(text)


if __name__ == "__main__":
    main()
