"""The profile file: a versioned JSON description of one machine running one model
(ARCHITECTURE §6). Pure: parsing and validation only — no torch, grpc, asyncio or clock.

Layout (version 1)::

    {
      "version": 1,
      "hardware": {"cpu_model": str, "cpu_cores": int, "memory_bytes": int,
                   "memory_bandwidth_bytes_per_s": float | null,
                   "gpu_model": str | null, "gpu_memory_bytes": int | null,
                   "cpu_threads": int | null, "torch_version": str | null, "device": str | null},
      "model": {"architecture": str, "num_layers": int, "hidden_size": int, "num_heads": int,
                "num_kv_heads": int, "head_dim": int, "vocab_size": int, "dtype": str,
                "block_size": int, "config_hash": str | null},
      "tables": {
        "gpu_prefill_ms":      {"tokens": [...], "ms": [...]},
        "gpu_decode_ms":       {"batch": [...], "context_tokens": [...], "ms": [[...], ...]},
        "cpu_dense_ms":        {"batch": [...], "ms": [...]},
        "cpu_attention_ms":    {"batch": [...], "context_tokens": [...], "ms": [[...], ...]},
        "assist_ms":           {"batch": [...], "ms": [...]},
        "lm_head_sampling_ms": {"batch": [...], "ms": [...]},
        optional: "gpu_dense_ms": {"batch": [...], "ms": [...]},
                  "assist_round_trip_ms": {"batch": [...], "ms": [...]}
      },
      "kv_transfer": {"bytes_per_s": float, "fixed_ms": float},
      "capacities": {"gpu_kv_blocks": int, "cpu_kv_blocks": int, "bytes_per_block": int},
      "notes": str (optional),
      "profiler": {...} (optional: how the profile was measured — grids, repeats, spread,
                  the cost model's fit against whole iterations; free-form, not validated)
    }

The fields marked `| null` in the fingerprints are optional (absent = null): profiles
assembled by hand (profiles/reference/) leave the measurement-environment fields out.
`cpu_threads` is the torch intra-op thread count the tables were measured with, `device`
where the "GPU" engine ran ("cuda:0", or "cpu" when this machine has no GPU and the GPU
engine's tables were measured on the CPU device), `config_hash` a digest of the model's
full configuration (dualpace.profile.fingerprint.model_config_hash).

What each table means (all latencies in milliseconds, one iteration):

- gpu_prefill_ms(tokens): a GPU engine iteration over `tokens` prompt tokens (dense +
  attention + LM head and sampling for the sequences that sample);
- gpu_decode_ms(batch, context_tokens): a GPU decode iteration of `batch` sequences whose
  mean context is `context_tokens` (KV tokens read per sequence), LM head and sampling included;
- cpu_dense_ms(batch): the dense stages (QKV, O, MLP of every layer) of a Local CPU
  iteration over `batch` tokens;
- cpu_attention_ms(batch, context_tokens): decode attention of every layer on the CPU over
  host KV, `batch` sequences of mean context `context_tokens`;
- assist_ms(batch): the Dense Assist part of an Assisted CPU iteration: one round trip per
  layer + the GPU's dense stages + LM head and sampling on the GPU (attention excluded);
- lm_head_sampling_ms(batch): final norm + LM head + sampling on the CPU (Local iterations).

Optional tables (informative; the cost model does not need them):

- gpu_dense_ms(batch): the GPU's share of assist_ms — dense stages of every layer + LM
  head and sampling on the GPU device, measured in-process;
- assist_round_trip_ms(batch): assist_ms - gpu_dense_ms, the transport's share (one
  round trip per layer plus serialisation), which decides whether assist pays off.

A 2-D table's "ms" is indexed [batch index][context index]. Grids must be strictly
increasing; values finite and >= 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dualpace.errors import DualPaceError

PROFILE_VERSION = 1

TABLES_1D = {
    "gpu_prefill_ms": "tokens",
    "cpu_dense_ms": "batch",
    "assist_ms": "batch",
    "lm_head_sampling_ms": "batch",
}
TABLES_2D = {
    "gpu_decode_ms": ("batch", "context_tokens"),
    "cpu_attention_ms": ("batch", "context_tokens"),
}
OPTIONAL_TABLES_1D = {
    "gpu_dense_ms": "batch",
    "assist_round_trip_ms": "batch",
}

# Relative tolerance when comparing memory sizes of two fingerprints: the OS reports
# slightly different totals on the same machine (kernel reservations, firmware).
MEMORY_TOLERANCE = 0.05


class ProfileError(DualPaceError):
    """A profile file is malformed, of another version, or for other hardware / another model."""


@dataclass(frozen=True)
class HardwareFingerprint:
    cpu_model: str
    cpu_cores: int
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float | None = None
    gpu_model: str | None = None
    gpu_memory_bytes: int | None = None
    cpu_threads: int | None = None
    torch_version: str | None = None
    device: str | None = None


@dataclass(frozen=True)
class ModelFingerprint:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    block_size: int
    config_hash: str | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class Table1D:
    axis: str
    grid: tuple[float, ...]
    ms: tuple[float, ...]


@dataclass(frozen=True)
class Table2D:
    axes: tuple[str, str]
    grid0: tuple[float, ...]
    grid1: tuple[float, ...]
    ms: tuple[tuple[float, ...], ...]  # [i over grid0][j over grid1]


@dataclass(frozen=True)
class KVTransfer:
    bytes_per_s: float
    fixed_ms: float


@dataclass(frozen=True)
class Capacities:
    gpu_kv_blocks: int
    cpu_kv_blocks: int
    bytes_per_block: int


@dataclass(frozen=True)
class Profile:
    version: int
    hardware: HardwareFingerprint
    model: ModelFingerprint
    tables: Mapping[str, Table1D | Table2D]
    kv_transfer: KVTransfer
    capacities: Capacities
    notes: str = ""
    profiler: Mapping[str, Any] | None = None  # how it was measured (free-form, see the module doc)

    def table1d(self, name: str) -> Table1D:
        table = self.tables[name]
        assert isinstance(table, Table1D)
        return table

    def table2d(self, name: str) -> Table2D:
        table = self.tables[name]
        assert isinstance(table, Table2D)
        return table


def dtype_bytes(dtype: str) -> int:
    sizes = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1}
    if dtype not in sizes:
        raise ProfileError(f"model.dtype: unknown dtype {dtype!r} (known: {', '.join(sorted(sizes))})")
    return sizes[dtype]


# ---------------------------------------------------------------------- parsing


def _require(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(obj, Mapping):
        raise ProfileError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise ProfileError(f"{where}.{key}: missing")
    return obj[key]


def _number(value: Any, where: str, *, minimum: float = 0.0, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}: expected a finite number, got {value!r}")
    if value < minimum or (positive and value <= 0):
        raise ProfileError(f"{where}: must be {'>' if positive else '>='} {minimum}, got {value!r}")
    return float(value)


def _int(value: Any, where: str, *, positive: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"{where}: expected an integer, got {value!r}")
    if value < (1 if positive else 0):
        raise ProfileError(f"{where}: must be {'>= 1' if positive else '>= 0'}, got {value}")
    return value


def _grid(values: Any, where: str) -> tuple[float, ...]:
    if not isinstance(values, Sequence) or isinstance(values, str) or not values:
        raise ProfileError(f"{where}: expected a non-empty list of numbers")
    grid = tuple(_number(v, f"{where}[{i}]") for i, v in enumerate(values))
    for i in range(1, len(grid)):
        if grid[i] <= grid[i - 1]:
            raise ProfileError(
                f"{where}: grid must be strictly increasing, but {where}[{i}] = {grid[i]:g} "
                f"follows {grid[i - 1]:g}")
    return grid


def _values(values: Any, length: int, where: str) -> tuple[float, ...]:
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise ProfileError(f"{where}: expected a list of numbers")
    if len(values) != length:
        raise ProfileError(f"{where}: has {len(values)} values, its grid has {length} points")
    return tuple(_number(v, f"{where}[{i}]") for i, v in enumerate(values))


def _parse_table1d(name: str, axis: str, raw: Any) -> Table1D:
    where = f"tables.{name}"
    grid = _grid(_require(raw, axis, where), f"{where}.{axis}")
    return Table1D(axis, grid, _values(_require(raw, "ms", where), len(grid), f"{where}.ms"))


def _parse_table2d(name: str, axes: tuple[str, str], raw: Any) -> Table2D:
    where = f"tables.{name}"
    grid0 = _grid(_require(raw, axes[0], where), f"{where}.{axes[0]}")
    grid1 = _grid(_require(raw, axes[1], where), f"{where}.{axes[1]}")
    rows = _require(raw, "ms", where)
    if not isinstance(rows, Sequence) or isinstance(rows, str) or len(rows) != len(grid0):
        raise ProfileError(f"{where}.ms: expected {len(grid0)} rows (one per {axes[0]} value)")
    ms = tuple(_values(row, len(grid1), f"{where}.ms[{i}]") for i, row in enumerate(rows))
    return Table2D(axes, grid0, grid1, ms)


def _parse_hardware(raw: Any) -> HardwareFingerprint:
    where = "hardware"
    bandwidth = raw.get("memory_bandwidth_bytes_per_s") if isinstance(raw, Mapping) else None
    gpu_model = raw.get("gpu_model") if isinstance(raw, Mapping) else None
    gpu_memory = raw.get("gpu_memory_bytes") if isinstance(raw, Mapping) else None
    cpu_model = _require(raw, "cpu_model", where)
    if not isinstance(cpu_model, str) or not cpu_model:
        raise ProfileError("hardware.cpu_model: expected a non-empty string")
    if gpu_model is not None and not isinstance(gpu_model, str):
        raise ProfileError("hardware.gpu_model: expected a string or null")
    return HardwareFingerprint(
        cpu_model=cpu_model,
        cpu_cores=_int(_require(raw, "cpu_cores", where), "hardware.cpu_cores"),
        memory_bytes=_int(_require(raw, "memory_bytes", where), "hardware.memory_bytes"),
        memory_bandwidth_bytes_per_s=None if bandwidth is None else _number(
            bandwidth, "hardware.memory_bandwidth_bytes_per_s", positive=True),
        gpu_model=gpu_model,
        gpu_memory_bytes=None if gpu_memory is None else _int(gpu_memory, "hardware.gpu_memory_bytes"),
        cpu_threads=None if raw.get("cpu_threads") is None else _int(raw["cpu_threads"], "hardware.cpu_threads"),
        torch_version=_optional_str(raw, "torch_version", where),
        device=_optional_str(raw, "device", where),
    )


def _optional_str(raw: Mapping[str, Any], key: str, where: str) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ProfileError(f"{where}.{key}: expected a non-empty string or null")
    return value


def _parse_model(raw: Any) -> ModelFingerprint:
    where = "model"
    values: dict[str, Any] = {}
    for f in fields(ModelFingerprint):
        if f.name == "config_hash":
            values[f.name] = _optional_str(raw, f.name, where)
            continue
        value = _require(raw, f.name, where)
        if f.name in ("architecture", "dtype"):
            if not isinstance(value, str) or not value:
                raise ProfileError(f"model.{f.name}: expected a non-empty string")
            values[f.name] = value
        else:
            values[f.name] = _int(value, f"model.{f.name}")
    model = ModelFingerprint(**values)
    dtype_bytes(model.dtype)
    return model


def parse_profile(data: Any) -> Profile:
    """A Profile from decoded JSON; ProfileError naming the first problem."""
    if not isinstance(data, Mapping):
        raise ProfileError("profile: expected a JSON object")
    version = _require(data, "version", "profile")
    if version != PROFILE_VERSION:
        raise ProfileError(f"version: this DualPace reads profile version {PROFILE_VERSION}, the file is version {version!r}")
    hardware = _parse_hardware(_require(data, "hardware", "profile"))
    model = _parse_model(_require(data, "model", "profile"))
    raw_tables = _require(data, "tables", "profile")
    tables: dict[str, Table1D | Table2D] = {}
    for name, axis in TABLES_1D.items():
        tables[name] = _parse_table1d(name, axis, _require(raw_tables, name, "tables"))
    for name, axes in TABLES_2D.items():
        tables[name] = _parse_table2d(name, axes, _require(raw_tables, name, "tables"))
    for name, axis in OPTIONAL_TABLES_1D.items():
        if raw_tables.get(name) is not None:
            tables[name] = _parse_table1d(name, axis, raw_tables[name])
    raw_transfer = _require(data, "kv_transfer", "profile")
    kv_transfer = KVTransfer(
        bytes_per_s=_number(_require(raw_transfer, "bytes_per_s", "kv_transfer"), "kv_transfer.bytes_per_s", positive=True),
        fixed_ms=_number(_require(raw_transfer, "fixed_ms", "kv_transfer"), "kv_transfer.fixed_ms"),
    )
    raw_caps = _require(data, "capacities", "profile")
    capacities = Capacities(
        gpu_kv_blocks=_int(_require(raw_caps, "gpu_kv_blocks", "capacities"), "capacities.gpu_kv_blocks", positive=False),
        cpu_kv_blocks=_int(_require(raw_caps, "cpu_kv_blocks", "capacities"), "capacities.cpu_kv_blocks", positive=False),
        bytes_per_block=_int(_require(raw_caps, "bytes_per_block", "capacities"), "capacities.bytes_per_block"),
    )
    expected_block_bytes = model.kv_bytes_per_token * model.block_size
    if capacities.bytes_per_block != expected_block_bytes:
        raise ProfileError(
            f"capacities.bytes_per_block: {capacities.bytes_per_block} does not match the model "
            f"({model.block_size} tokens x {model.kv_bytes_per_token} KV bytes per token = {expected_block_bytes})")
    notes = data.get("notes", "")
    profiler = data.get("profiler")
    if profiler is not None and not isinstance(profiler, Mapping):
        raise ProfileError("profiler: expected an object or null")
    return Profile(PROFILE_VERSION, hardware, model, tables, kv_transfer, capacities,
                   notes if isinstance(notes, str) else "", profiler)


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON object for `profile` (parse_profile(profile_to_dict(p)) == p)."""
    tables: dict[str, Any] = {}
    for name, table in profile.tables.items():
        if isinstance(table, Table1D):
            tables[name] = {table.axis: list(table.grid), "ms": list(table.ms)}
        else:
            tables[name] = {table.axes[0]: list(table.grid0), table.axes[1]: list(table.grid1),
                            "ms": [list(row) for row in table.ms]}
    out = {
        "version": profile.version,
        "hardware": _without_nulls(asdict(profile.hardware), _OPTIONAL_HARDWARE),
        "model": _without_nulls(asdict(profile.model), ("config_hash",)),
        "tables": tables,
        "kv_transfer": asdict(profile.kv_transfer),
        "capacities": asdict(profile.capacities),
    }
    if profile.notes:
        out["notes"] = profile.notes
    if profile.profiler is not None:
        out["profiler"] = dict(profile.profiler)
    return out


_OPTIONAL_HARDWARE = ("cpu_threads", "torch_version", "device")


def _without_nulls(values: dict[str, Any], optional: Sequence[str]) -> dict[str, Any]:
    """Drop the optional fields that are None (older files never had them)."""
    return {k: v for k, v in values.items() if v is not None or k not in optional}


# ---------------------------------------------------------------------- fingerprints


def fingerprint_mismatches(profile: Profile, hardware: HardwareFingerprint | None = None,
                           model: ModelFingerprint | None = None,
                           ignore: Sequence[str] = ()) -> list[str]:
    """Human-readable differences between the profile's fingerprints and the given ones.

    Model fields must match exactly (config_hash only when both sides have one). Hardware:
    CPU model, cores and GPU model exactly; memory sizes within MEMORY_TOLERANCE; threads,
    torch version and device exactly when both sides record them; the measured bandwidth
    is not compared (it is a measurement, not an identity). `ignore` names fields to skip,
    as "model.dtype" or "hardware.cpu_threads"."""
    problems = []
    if model is not None:
        for f in fields(ModelFingerprint):
            if f"model.{f.name}" in ignore:
                continue
            ours, theirs = getattr(profile.model, f.name), getattr(model, f.name)
            if f.name == "config_hash" and (ours is None or theirs is None):
                continue
            if ours != theirs:
                problems.append(f"model.{f.name}: profile has {ours!r}, this deployment has {theirs!r}")
    if hardware is not None:
        for name in ("cpu_model", "cpu_cores", "gpu_model", "cpu_threads", "torch_version", "device"):
            if f"hardware.{name}" in ignore:
                continue
            ours, theirs = getattr(profile.hardware, name), getattr(hardware, name)
            if name in _OPTIONAL_HARDWARE and (ours is None or theirs is None):
                continue
            if ours != theirs:
                problems.append(f"hardware.{name}: profile has {ours!r}, this machine has {theirs!r}")
        for name in ("memory_bytes", "gpu_memory_bytes"):
            if f"hardware.{name}" in ignore:
                continue
            ours, theirs = getattr(profile.hardware, name), getattr(hardware, name)
            if (ours is None) != (theirs is None) or (
                    ours is not None and abs(ours - theirs) > MEMORY_TOLERANCE * max(ours, theirs)):
                problems.append(f"hardware.{name}: profile has {ours!r}, this machine has {theirs!r}")
    return problems


def check_fingerprints(profile: Profile, hardware: HardwareFingerprint | None = None,
                       model: ModelFingerprint | None = None, allow_mismatch: bool = False) -> list[str]:
    """Raise ProfileError listing every mismatch, unless allow_mismatch (then return them)."""
    problems = fingerprint_mismatches(profile, hardware, model)
    if problems and not allow_mismatch:
        raise ProfileError("profile does not match (pass allow_mismatch to use it anyway): " + "; ".join(problems))
    return problems


def load_profile(path: str | Path, hardware: HardwareFingerprint | None = None,
                 model: ModelFingerprint | None = None, allow_mismatch: bool = False) -> Profile:
    """Read, validate and (when fingerprints are given) check a profile file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"profile {path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid JSON: {exc}") from None
    try:
        profile = parse_profile(data)
    except ProfileError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None
    check_fingerprints(profile, hardware, model, allow_mismatch)
    return profile


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile_to_dict(profile), indent=1) + "\n")
