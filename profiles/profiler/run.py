"""`dualpace profile`: measure this machine for one model, or reuse a stored profile whose
fingerprints (and grids) match.

Steps: fingerprints -> reuse check -> load the model -> start a real gpu_service -> measure
every table over its grid (warm-up + repeats, median kept, a progress bar) -> derive the
components the cost model adds up -> write JSON + PNG -> check the file loads in the cost model.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dualpace.errors import InvalidArgument
from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.profile.files import load_profile, save_profile
from dualpace.profile.schema import (
    PROFILE_VERSION,
    Capacities,
    KVTransfer,
    Profile,
    ProfileError,
    Table1D,
    Table2D,
    fingerprint_mismatches,
)

LOCAL_DIR = Path(__file__).resolve().parent.parent / "local"
STAND_IN_GPU_KV_BLOCKS = 256  # gpu_service's default pool, for a GPU engine running on the CPU device
GPU_MEMORY_FRACTION = 0.9  # of the CUDA device's memory, for weights + KV
CPU_MEMORY_FRACTION = 0.5  # of available host memory, for the CPU engine's weights + KV


@dataclass(frozen=True)
class Grids:
    prefill_tokens: tuple[int, ...]
    batch: tuple[int, ...]
    context_tokens: tuple[int, ...]
    kv_transfer_tokens: tuple[int, ...]
    warmup: int
    repeats: int
    statistic: str = "median"  # what a table stores of a point's repeats: "median" or "min"


DEFAULT_GRIDS = Grids(prefill_tokens=(16, 64, 128, 256, 512, 1024), batch=(1, 2, 4, 8, 16, 32, 64),
                      context_tokens=(32, 256, 1024, 2048), kv_transfer_tokens=(64, 512, 2048),
                      warmup=2, repeats=5)
QUICK_GRIDS = Grids(prefill_tokens=(16, 64), batch=(1, 4), context_tokens=(16, 64), kv_transfer_tokens=(16, 64),
                    warmup=1, repeats=2)


@dataclass
class ProfileRequest:
    model: str
    dtype: str = "auto"
    threads: int = 1
    block_size: int = 16
    device: str = "auto"  # where the GPU engine runs: auto (cuda when available, else the CPU), cuda or cpu
    grids: Grids = DEFAULT_GRIDS
    out: Path | None = None
    force: bool = False
    gpu_kv_blocks: int | None = None
    cpu_kv_blocks: int | None = None
    progress: bool = True
    notes: str = ""
    log: Callable[[str], None] = field(default=print)


def default_threads() -> int:
    """Half the cores: on a machine without a GPU both engines share the CPU."""
    return max(1, (os.cpu_count() or 2) // 2)


STATISTICS = ("median", "min")
KV_TRANSFER_REPEAT_FACTOR = 3  # transfers are short and their fit is sensitive to noise: more repeats


def grids_dict(grids: Grids) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grids).items()}


def default_path(model_name: str, dtype: str, hardware) -> Path:
    from profiles.profiler.measure import slug

    words = slug(hardware.cpu_model).split("-")[:3]
    device = "cpu" if hardware.device == "cpu" else slug(hardware.gpu_model or hardware.device)
    name = f"{slug(Path(model_name).name)}-{dtype}-{'-'.join(words)}-{hardware.cpu_cores}c-t{hardware.cpu_threads}-{device}"
    return LOCAL_DIR / f"{name}.json"


def reuse_problems(stored: Profile, hardware, model, grids: Grids) -> list[str]:
    """Why a stored profile cannot stand for a new measurement (empty: reuse it)."""
    problems = fingerprint_mismatches(stored, hardware, model)
    for name in ("cpu_threads", "torch_version", "device"):
        if getattr(stored.hardware, name) != getattr(hardware, name):
            problems.append(f"hardware.{name}: stored {getattr(stored.hardware, name)!r}, now {getattr(hardware, name)!r}")
    if stored.model.config_hash != model.config_hash:
        problems.append(f"model.config_hash: stored {stored.model.config_hash!r}, now {model.config_hash!r}")
    stored_grids = (stored.profiler or {}).get("grids")
    if stored_grids != grids_dict(grids):
        problems.append("grids: the stored profile was measured over other grids or repeats")
    return sorted(set(problems))


class _Progress:
    """A rich progress bar over the measured points (or nothing)."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("[bold]{task.description:<28}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("profiling", total=total)
            self.bar.start()

    def step(self, description: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=description)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_profile(request: ProfileRequest) -> tuple[Path, Profile, bool]:
    """(path, profile, reused)."""
    import torch

    from dualpace.model.loader import load_model, load_tokenizer_and_config, moe_weight_bytes, resolve_device, resolve_dtype
    from dualpace.profile.fingerprint import meminfo_bytes, model_fingerprint
    from profiles.profiler import measure as m
    from profiles.profiler.hardware import hardware_fingerprint
    from profiles.profiler.plots import plot_profile
    from profiles.profiler.timing import measure
    from toolkit.memory_bandwidth import copy_bandwidth_bytes_per_s

    grids = request.grids
    torch.set_num_threads(request.threads)
    device = str(resolve_device(request.device))
    if device == "cuda":
        device = "cuda:0"
    torch_dtype = resolve_dtype(request.dtype, torch.device(device).type)  # auto: what is fastest on that device
    _, config = load_tokenizer_and_config(request.model)
    for flag, values in (("--prefill-tokens", grids.prefill_tokens), ("--context-tokens", grids.context_tokens),
                         ("--kv-transfer-tokens", [t + 1 for t in grids.kv_transfer_tokens])):
        if max(values) > config.max_position_embeddings:
            raise InvalidArgument(flag, f"{max(values)} tokens exceed the model's context of "
                                        f"{config.max_position_embeddings}")
    model_fp = model_fingerprint(config, torch_dtype, request.block_size)
    hardware_now = hardware_fingerprint(request.threads, device)
    path = request.out or default_path(request.model, model_fp.dtype, hardware_now)

    if path.exists() and not request.force:
        try:
            stored = load_profile(path)
        except ProfileError as exc:
            request.log(f"stored profile {path} is unreadable ({exc}); measuring again")
        else:
            problems = reuse_problems(stored, hardware_now, model_fp, grids)
            if not problems:
                request.log(f"reusing the stored profile {path}: its fingerprints match this machine and model "
                            "(--force measures again)")
                return path, stored, True
            request.log(f"stored profile {path} does not match ({'; '.join(problems)}); measuring again")

    started = time.monotonic()
    # A quick indicator, not a STREAM run: a smaller copy and fewer repeats than the benchmarks'.
    bandwidth = copy_bandwidth_bytes_per_s(num_bytes=256 * 2**20, repeats=3)
    hardware = hardware_fingerprint(request.threads, device, bandwidth)
    loaded = load_model(request.model, dtype=torch_dtype, device="cpu")
    model_fp = replace(model_fp, moe=moe_weight_bytes(loaded.model.weights, loaded.config))  # MoE: bytes a step reads
    moves_kv = not loaded.config.mixes_window_and_global_layers  # else a move recomputes (EngineCore.moves_kv)
    request.log(f"profiling {request.model} ({model_fp.dtype}) on {hardware.cpu_model}, {hardware.cpu_cores} cores, "
                f"{request.threads} threads, GPU engine on {device}{'; MoE ' + model_fp.moe.summary() if model_fp.moe else ''}")
    max_context = max(grids.context_tokens)
    cpu_blocks = max(max(grids.batch) * m.blocks_needed(max_context, request.block_size),
                     m.blocks_needed(max(max(grids.prefill_tokens), max(grids.kv_transfer_tokens)), request.block_size))
    cpu_bench = m.RunnerBench(loaded, cpu_blocks, request.block_size)
    if device == "cpu":
        gpu_bench = cpu_bench
    else:
        gpu_bench = m.RunnerBench(load_model(request.model, dtype=torch_dtype, device=device), cpu_blocks,
                                  request.block_size)
    target_blocks = 2 * m.blocks_needed(max(grids.kv_transfer_tokens) + 1, request.block_size) + 16
    service = m.start_gpu_service(request.model, model_fp.dtype, "cpu" if device == "cpu" else "cuda",
                                  request.threads, target_blocks, request.block_size)
    samples: dict[str, dict] = {}

    def pick(sample) -> float:
        return sample.min_ms if grids.statistic == "min" else sample.median_ms
    num_points = (len(grids.prefill_tokens) + 2 * len(grids.batch) * len(grids.context_tokens) * (1 if device == "cpu" else 1.5)
                  + 5 * len(grids.batch) + 3 * len(grids.kv_transfer_tokens))
    progress = _Progress(request.progress, int(num_points))
    from cpu_service.assist_client import AssistClient

    client = AssistClient(service.address, iteration_timeout_s=60.0)  # auto: the shm rings on this host
    tcp_client = AssistClient(service.address, iteration_timeout_s=60.0, transport="tcp")
    try:
        def point(table: str, key: str, fn, description: str):
            sample = measure(fn, grids.warmup, grids.repeats)
            samples.setdefault(table, {})[key] = sample.as_dict()
            progress.step(description)
            return pick(sample)

        prefill = [point("gpu_prefill", str(t), gpu_bench.iteration(gpu_bench.prefill_plan(t)), f"GPU prefill {t}")
                   for t in grids.prefill_tokens]
        # Each whole Local iteration is measured right before the attention at the same point, so
        # the dense part derived from their difference sees the same background load.
        local = [[0.0] * len(grids.context_tokens) for _ in grids.batch]
        attention = [[0.0] * len(grids.context_tokens) for _ in grids.batch]
        for i, b in enumerate(grids.batch):
            for j, c in enumerate(grids.context_tokens):
                local[i][j] = point("cpu_local_iteration", f"{b}x{c}",
                                    cpu_bench.iteration(cpu_bench.decode_plan(b, c)), f"CPU local decode {b}x{c}")
                attention[i][j] = point("cpu_attention", f"{b}x{c}", cpu_bench.attention(b, c),
                                        f"CPU attention {b}x{c}")
        if gpu_bench is cpu_bench:
            gpu_decode = local
        else:
            gpu_decode = [[point("gpu_decode", f"{b}x{c}", gpu_bench.iteration(gpu_bench.decode_plan(b, c)),
                                 f"GPU decode {b}x{c}") for c in grids.context_tokens] for b in grids.batch]
        lm_head = [point("lm_head_sampling", str(b), cpu_bench.lm_head_sampling(b), f"LM head {b}")
                   for b in grids.batch]
        gpu_dense = [point("gpu_dense", str(b), gpu_bench.dense(b), f"GPU dense {b}") for b in grids.batch]
        cfg = loaded.config

        def assist_over(table: str, over, label: str) -> list[float]:
            return [point(table, str(b), m.assist_iteration(over, b, cfg.num_heads, cfg.head_dim, loaded.model.dtype),
                          f"Dense Assist {b}{label}") for b in grids.batch]

        assist = assist_over("assist", client, "")
        assist_tcp = assist_over("assist_tcp", tcp_client, " over TCP")  # gpu_service's data socket
        assist_path = client.data_path  # shm on this host, tcp where the ring was refused
        # Whole Assisted iterations (cpu_service's AssistedForward: real attention over host KV
        # between the round trips) at one context, to check assist_ms + cpu_attention_ms.
        from cpu_service.assisted_forward import AssistedForward

        assisted_forward = AssistedForward(cpu_bench.runner.kv, cfg, client)
        check_context = grids.context_tokens[len(grids.context_tokens) // 2]
        def assisted(plan):
            return lambda: assisted_forward.execute(plan)

        assisted_whole = [point("cpu_assisted_iteration", f"{b}x{check_context}",
                                assisted(cpu_bench.decode_plan(b, check_context)),
                                f"CPU assisted decode {b}x{check_context}") for b in grids.batch]
        transfers: dict[str, list[tuple[int, float]]] = {"shm": [], "tcp": []}
        for path_name, table in (("shm", "kv_transfer_shm"), ("tcp", "kv_transfer_tcp")) if moves_kv else ():
            for t in grids.kv_transfer_tokens:
                sample = m.kv_transfer(service.address, cpu_bench.runner, cfg.vocab_size, t, grids.warmup,
                                       KV_TRANSFER_REPEAT_FACTOR * grids.repeats, path=path_name)
                if sample is None:  # the target declined shared memory (e.g. a CUDA pool) or its data socket
                    break
                samples.setdefault(table, {})[str(t)] = sample.as_dict()
                transfers[path_name].append((t * model_fp.kv_bytes_per_token, pick(sample)))
                progress.step(f"KV transfer {t} ({path_name})")
    finally:
        progress.close()
        client.close()
        tcp_client.close()
        service.stop()

    # The cost model adds dense + attention + LM head for a Local iteration; the dense part is
    # what remains of the measured whole iterations (least squares over the context grid).
    cpu_dense = []
    for i in range(len(grids.batch)):
        rest = [local[i][j] - attention[i][j] for j in range(len(grids.context_tokens))]
        cpu_dense.append(max(0.0, sum(rest) / len(rest) - lm_head[i]))
    round_trip = [max(0.0, a - d) for a, d in zip(assist, gpu_dense)]
    fits = {name: KVTransfer(*(round(v, 4) for v in m.fit_transfer(points)))
            for name, points in transfers.items() if len(points) == len(grids.kv_transfer_tokens)}
    # The plain figures are the paths the daemons take by default on this host (older readers use them).
    recompute = None if moves_kv else [(t * model_fp.kv_bytes_per_token, ms) for t, ms in zip(grids.prefill_tokens, prefill)]
    kv_path, kv_default = m.default_kv_transfer(fits, transfers, recompute)
    bytes_per_block = model_fp.kv_bytes_per_token * model_fp.block_size
    weight_bytes = loaded.model.weights.num_bytes()
    if request.gpu_kv_blocks is not None:
        gpu_kv_blocks, gpu_rule = request.gpu_kv_blocks, "given (--gpu-kv-blocks)"
    elif device == "cpu":
        gpu_kv_blocks, gpu_rule = STAND_IN_GPU_KV_BLOCKS, "no GPU: gpu_service's default pool on the CPU device"
    else:
        gpu_kv_blocks = max(0, int((GPU_MEMORY_FRACTION * hardware.gpu_memory_bytes - weight_bytes) // bytes_per_block))
        gpu_rule = f"{GPU_MEMORY_FRACTION:g} x GPU memory - weights"
    if request.cpu_kv_blocks is not None:
        cpu_kv_blocks, cpu_rule = request.cpu_kv_blocks, "given (--cpu-kv-blocks)"
    else:
        available = meminfo_bytes("MemAvailable") or hardware.memory_bytes
        cpu_kv_blocks = max(0, int((CPU_MEMORY_FRACTION * available - weight_bytes) // bytes_per_block))
        cpu_rule = f"{CPU_MEMORY_FRACTION:g} x available host memory ({available / 2**30:.1f} GiB) - weights"

    batch = tuple(float(b) for b in grids.batch)
    context = tuple(float(c) for c in grids.context_tokens)

    def t2(values):
        return tuple(tuple(round(v, 4) for v in row) for row in values)

    def t1(values):
        return tuple(round(v, 4) for v in values)

    tables = {
        "gpu_prefill_ms": Table1D("tokens", tuple(float(t) for t in grids.prefill_tokens), t1(prefill)),
        "gpu_decode_ms": Table2D(("batch", "context_tokens"), batch, context, t2(gpu_decode)),
        "cpu_dense_ms": Table1D("batch", batch, t1(cpu_dense)),
        "cpu_attention_ms": Table2D(("batch", "context_tokens"), batch, context, t2(attention)),
        "assist_ms": Table1D("batch", batch, t1(assist)),
        "lm_head_sampling_ms": Table1D("batch", batch, t1(lm_head)),
        "gpu_dense_ms": Table1D("batch", batch, t1(gpu_dense)),
        "assist_round_trip_ms": Table1D("batch", batch, t1(round_trip)),
        f"assist_ms_{assist_path}": Table1D("batch", batch, t1(assist)),
        "assist_ms_tcp": Table1D("batch", batch, t1(assist_tcp)),
    }
    spreads = [s["max_ms"] / s["median_ms"] - s["min_ms"] / s["median_ms"]
               for table in samples.values() for s in table.values() if s["median_ms"] > 0]
    meta = {
        "tool": "dualpace profile",
        "statistic": f"each table value is the {grids.statistic} of its point's timed repeats",
        "model": request.model,
        "grids": grids_dict(grids),
        "duration_s": None,
        "measured_at_unix_s": int(time.time()),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "median_spread": round(sorted(spreads)[len(spreads) // 2], 3) if spreads else None,
        "max_spread": round(max(spreads), 3) if spreads else None,
        "gpu_engine": ("on the CPU device (no GPU here): gpu_prefill_ms and gpu_decode_ms are the same runner on "
                       "the same cores as the CPU engine; gpu_decode_ms is the CPU Local iteration measurement")
                      if device == "cpu" else f"on {device}",
        "capacities": {"gpu_kv_blocks": gpu_rule, "cpu_kv_blocks": cpu_rule, "weight_bytes": weight_bytes},
        "memory_bandwidth": "copy of 256 MiB, read + write bytes counted, best of 3",
        "kv_transfer_fit_points": [[b, round(ms, 4)] for b, ms in transfers[kv_path]],
        "kv_transfer_fit_points_by_path": {name: [[b, round(ms, 4)] for b, ms in points]
                                           for name, points in transfers.items()},
        "data_paths": f"assist_ms is over {assist_path}; {m.kv_path_note(kv_path)}",
        "samples": samples,
    }
    profile = Profile(PROFILE_VERSION, hardware, model_fp, tables, kv_default,
                      Capacities(gpu_kv_blocks, cpu_kv_blocks, bytes_per_block), request.notes, meta, fits)
    meta["local_fit"] = local_fit(profile, grids, local)
    meta["assisted_fit"] = assisted_fit(profile, grids, check_context, assisted_whole)
    meta["duration_s"] = round(time.monotonic() - started, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    profile = load_profile(path, hardware, model_fp)  # what was written loads, validates and matches
    plot_profile(profile, path.with_suffix(".png"))
    return path, profile, False


def local_fit(profile: Profile, grids: Grids, measured: list[list[float]]) -> dict:
    """How well the cost model's sum (dense + attention + LM head) reproduces the measured
    whole Local iterations at the grid points."""
    cost = CostModel(profile)
    errors = []
    for i, b in enumerate(grids.batch):
        for j, c in enumerate(grids.context_tokens):
            predicted = cost.cpu_local_ms(DecodeBatch(b, float(c)))
            errors.append(abs(predicted - measured[i][j]) / measured[i][j] if measured[i][j] > 0 else 0.0)
    return {"what": "|predicted - measured| / measured of whole Local iterations over the grid",
            "mean_relative_error": round(sum(errors) / len(errors), 4),
            "max_relative_error": round(max(errors), 4)}


def assisted_fit(profile: Profile, grids: Grids, context: int, measured: list[float]) -> dict:
    """How well assist_ms + cpu_attention_ms reproduces whole Assisted iterations (one context)."""
    cost = CostModel(profile)
    errors = [abs(cost.cpu_assisted_ms(DecodeBatch(b, float(context))) - ms) / ms
              for b, ms in zip(grids.batch, measured) if ms > 0]
    return {"what": f"|predicted - measured| / measured of whole Assisted iterations at context {context}",
            "mean_relative_error": round(sum(errors) / len(errors), 4),
            "max_relative_error": round(max(errors), 4)}


def headline(profile: Profile) -> list[str]:
    """A few numbers to print after profiling."""
    cost = CostModel(profile)
    lines = []
    for b in (1, 8, 32):
        d = DecodeBatch(b, 512.0)
        it = cost.cpu_iteration(d)
        lines.append(f"batch {b:>2} @ 512 ctx: CPU local {it.local_ms:7.1f} ms, assisted {it.assisted_ms:7.1f} ms, "
                     f"GPU-engine decode {cost.gpu_decode_ms(b, 512.0):7.1f} ms")
    lines.append(f"prefill 512 tokens: {cost.gpu_prefill_ms(512):.1f} ms; KV transfer: "
                 f"{profile.kv_transfer.bytes_per_s / 1e9:.2f} GB/s + {profile.kv_transfer.fixed_ms:.1f} ms fixed "
                 f"(1024 tokens: {cost.kv_transfer_ms(1024):.1f} ms)")
    if math.isfinite(profile.hardware.memory_bandwidth_bytes_per_s or math.nan):
        lines.append(f"host copy bandwidth {profile.hardware.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s")
    return lines
