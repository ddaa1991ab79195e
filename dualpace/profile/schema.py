"""The profile file: a versioned JSON description of one machine running one model (what the daemons
read to seed their decisions): its types, its format and the fingerprint comparison; files.py
parses, validates, reads and writes it. Pure: no torch, grpc, asyncio or clock.

Layout (version 1)::

    {
      "version": 1,
      "hardware": {"cpu_model": str, "cpu_cores": int, "memory_bytes": int,
                   "memory_bandwidth_bytes_per_s": float | null,
                   "gpu_model": str | null, "gpu_memory_bytes": int | null,
                   "cpu_threads": int | null, "torch_version": str | null, "device": str | null},
      "model": {"architecture": str, "num_layers": int, "hidden_size": int, "num_heads": int,
                "num_kv_heads": int, "head_dim": int, "vocab_size": int, "dtype": str,
                "block_size": int, "config_hash": str | null,
                "moe": {"num_experts": int, "num_experts_per_tok": int, "dense_bytes": int,
                        "expert_bytes": int, "num_sparse_layers": int} | null},
      "tables": {
        "gpu_prefill_ms":      {"tokens": [...], "ms": [...]},
        "gpu_decode_ms":       {"batch": [...], "context_tokens": [...], "ms": [[...], ...]},
        "cpu_dense_ms":        {"batch": [...], "ms": [...]},
        "cpu_attention_ms":    {"batch": [...], "context_tokens": [...], "ms": [[...], ...]},
        "assist_ms":           {"batch": [...], "ms": [...]},
        "lm_head_sampling_ms": {"batch": [...], "ms": [...]},
        optional: "gpu_dense_ms": {"batch": [...], "ms": [...]},
                  "assist_round_trip_ms": {"batch": [...], "ms": [...]},
                  "assist_ms_shm": {"batch": [...], "ms": [...]},
                  "assist_ms_tcp": {"batch": [...], "ms": [...]}
      },
      "kv_transfer": {"bytes_per_s": float, "fixed_ms": float},
      "kv_transfer_paths": {"shm": {"bytes_per_s", "fixed_ms"}, "tcp": {...}} (optional),
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

Data paths: KV transfer and Dense Assist run through shared memory between daemons on one host
and over a TCP data socket otherwise, at very different costs. A profile may carry each:
`kv_transfer_paths` ("shm", "tcp") and the tables assist_ms_shm / assist_ms_tcp. An older profile
may also hold figures of a gRPC data path (kv_transfer_paths "grpc", table assist_ms_grpc); no
transfer takes that path any more, so reading skips them with one log line. The plain
`kv_transfer` and `assist_ms` stay (older profiles have only them) and hold the path the
profiler's daemons used by default; dualpace.profile.data_paths picks the figures of the path in
force, falling back as its module doc says.

A 2-D table's "ms" is indexed [batch index][context index]. Grids must be strictly
increasing; values finite and >= 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from dualpace.errors import DualPaceError
from dualpace.model.moe_spec import MoeWeightBytes

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
    "assist_ms_shm": "batch",
    "assist_ms_tcp": "batch",
}
# shared memory on one host; the TCP data socket (KV and assist across hosts, gRPC as its control plane)
DATA_PATHS = ("shm", "tcp")
# A data path older profiles measured (gRPC chunks) that no transfer takes: its entries
# (kv_transfer_paths.grpc, tables.assist_ms_grpc) are skipped on reading, never priced.
RETIRED_DATA_PATH = "grpc"

# Relative tolerance when comparing memory sizes of two fingerprints: the OS reports
# slightly different totals on the same machine (kernel reservations, firmware).
MEMORY_TOLERANCE = 0.05
# Hardware fields a hand-assembled profile may leave out (absent = null).
OPTIONAL_HARDWARE_FIELDS = ("cpu_threads", "torch_version", "device", "cpu_kernel_variant", "cpu_flags", "cpu_amx")


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
    cpu_kernel_variant: str | None = None  # dualpace.model.cpu_kernels' variant the CPU tables were measured with
    cpu_flags: tuple[str, ...] | None = None  # the CPU flags the kernel variants (and their AMX tiles) depend on
    cpu_amx: bool | None = None  # whether those kernels ran bf16 products on AMX tiles (None: not recorded)


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
    # a mixture-of-experts model's bytes read per step, dense part and one expert apart (in the
    # formats the profiled engine held); derived, so not compared (config_hash covers the routing)
    moe: MoeWeightBytes | None = None

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
    kv_transfer_paths: Mapping[str, KVTransfer] = field(default_factory=dict)  # by DATA_PATHS name

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
            if f.name == "moe" or (f.name == "config_hash" and (ours is None or theirs is None)):
                continue
            if ours != theirs:
                problems.append(f"model.{f.name}: profile has {ours!r}, this deployment has {theirs!r}")
    if hardware is not None:
        for name in ("cpu_model", "cpu_cores", "gpu_model", "cpu_threads", "torch_version", "device", "cpu_kernel_variant",
                     "cpu_amx"):
            if f"hardware.{name}" in ignore:
                continue
            ours, theirs = getattr(profile.hardware, name), getattr(hardware, name)
            if name in OPTIONAL_HARDWARE_FIELDS and (ours is None or theirs is None):
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
