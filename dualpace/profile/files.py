"""Profile files: parsing and validating a profile's JSON into the schema's types (one-line
ProfileError naming the field), writing it back, and reading a file with the fingerprint
check. The format itself is described in schema.py."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from dualpace.model.moe_spec import MoeWeightBytes
from dualpace.profile.schema import (
    DATA_PATHS,
    OPTIONAL_HARDWARE_FIELDS,
    OPTIONAL_TABLES_1D,
    PROFILE_VERSION,
    RETIRED_DATA_PATH,
    TABLES_1D,
    TABLES_2D,
    Capacities,
    HardwareFingerprint,
    KVTransfer,
    ModelFingerprint,
    Profile,
    ProfileError,
    Table1D,
    Table2D,
    check_fingerprints,
    dtype_bytes,
)

log = logging.getLogger(__name__)


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
        cpu_kernel_variant=_optional_str(raw, "cpu_kernel_variant", where),
        cpu_flags=_optional_flags(raw, where),
        cpu_amx=_optional_bool(raw, "cpu_amx", where),
    )


def _optional_flags(raw: Mapping[str, Any], where: str) -> tuple[str, ...] | None:
    value = raw.get("cpu_flags")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(flag, str) and flag for flag in value):
        raise ProfileError(f"{where}.cpu_flags: expected a list of flag names")
    return tuple(value)


def _optional_bool(raw: Mapping[str, Any], key: str, where: str) -> bool | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProfileError(f"{where}.{key}: expected true, false or null")
    return value


def _optional_str(raw: Mapping[str, Any], key: str, where: str) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ProfileError(f"{where}.{key}: expected a non-empty string or null")
    return value


def _optional_moe(raw: Any) -> MoeWeightBytes | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProfileError("model.moe: expected an object or null")
    values = {f.name: _int(_require(raw, f.name, "model.moe"), f"model.moe.{f.name}") for f in fields(MoeWeightBytes)}
    if not 0 < values["num_experts_per_tok"] <= values["num_experts"]:
        raise ProfileError("model.moe: num_experts_per_tok must be in 1..num_experts")
    return MoeWeightBytes(**values)


def _parse_model(raw: Any) -> ModelFingerprint:
    where = "model"
    values: dict[str, Any] = {}
    for f in fields(ModelFingerprint):
        if f.name == "config_hash":
            values[f.name] = _optional_str(raw, f.name, where)
            continue
        if f.name == "moe":
            values[f.name] = _optional_moe(raw.get("moe"))
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


def parse_profile(data: Any, source: str = "profile") -> Profile:
    """A Profile from decoded JSON; ProfileError naming the first problem. `source` names the
    profile in the log line about skipped entries (see _log_retired_entries)."""
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
    kv_transfer = _parse_transfer(_require(data, "kv_transfer", "profile"), "kv_transfer")
    kv_transfer_paths = _parse_transfer_paths(data.get("kv_transfer_paths"))
    _log_retired_entries(data.get("kv_transfer_paths"), raw_tables, source)
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
                   notes if isinstance(notes, str) else "", profiler, kv_transfer_paths)


def _parse_transfer(raw: Any, where: str) -> KVTransfer:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: expected an object")
    return KVTransfer(
        bytes_per_s=_number(_require(raw, "bytes_per_s", where), f"{where}.bytes_per_s", positive=True),
        fixed_ms=_number(_require(raw, "fixed_ms", where), f"{where}.fixed_ms"),
    )


def _parse_transfer_paths(raw: Any) -> dict[str, KVTransfer]:
    """The optional per-path KV transfer figures (absent in older profiles: {})."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ProfileError("kv_transfer_paths: expected an object")
    unknown = sorted(set(raw) - {*DATA_PATHS, RETIRED_DATA_PATH})
    if unknown:
        raise ProfileError(f"kv_transfer_paths: unknown path {unknown[0]!r} (known: {', '.join(DATA_PATHS)})")
    return {path: _parse_transfer(value, f"kv_transfer_paths.{path}") for path, value in raw.items()
            if path != RETIRED_DATA_PATH}


def _log_retired_entries(raw_paths: Mapping[str, Any] | None, raw_tables: Mapping[str, Any], source: str) -> None:
    """One log line when an older profile holds figures of the retired gRPC data path (skipped)."""
    retired_table = f"assist_ms_{RETIRED_DATA_PATH}"
    retired = [f"kv_transfer_paths.{RETIRED_DATA_PATH}"] if raw_paths and RETIRED_DATA_PATH in raw_paths else []
    if retired_table in raw_tables:
        retired.append(f"tables.{retired_table}")
    if retired:
        log.warning("%s: skipping %s: figures of a gRPC data path no transfer takes (KV and Dense Assist move "
                    "over %s; `dualpace profile` measures both)", source, ", ".join(retired), " or ".join(DATA_PATHS))


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
        "hardware": _without_nulls(asdict(profile.hardware), OPTIONAL_HARDWARE_FIELDS),
        "model": _without_nulls(asdict(profile.model), ("config_hash", "moe")),
        "tables": tables,
        "kv_transfer": asdict(profile.kv_transfer),
        "capacities": asdict(profile.capacities),
    }
    if profile.kv_transfer_paths:
        out["kv_transfer_paths"] = {path: asdict(t) for path, t in profile.kv_transfer_paths.items()}
    if profile.notes:
        out["notes"] = profile.notes
    if profile.profiler is not None:
        out["profiler"] = dict(profile.profiler)
    return out


def _without_nulls(values: dict[str, Any], optional: Sequence[str]) -> dict[str, Any]:
    """Drop the optional fields that are None (older files never had them)."""
    return {k: v for k, v in values.items() if v is not None or k not in optional}


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
        profile = parse_profile(data, source=f"profile {path}")
    except ProfileError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None
    check_fingerprints(profile, hardware, model, allow_mismatch)
    return profile


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile_to_dict(profile), indent=1) + "\n")
