"""Fingerprints: which machine and which model a profile describes.

model_fingerprint works from a ModelConfig without weights (the router has no weights);
cpu_model_name and memory_bytes read /proc. Torch-free: the daemons' --profile check uses
it; the profiler's full hardware fingerprint (which asks torch about the device) is
profiles/profiler/hardware.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict

from dualpace.model.config import ModelConfig
from dualpace.profile.schema import ModelFingerprint

DTYPE_NAMES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16",
               "fp16": "fp16"}


def model_config_hash(config: ModelConfig) -> str:
    """A short digest of every field of the model's configuration (shape, RoPE, norms,
    special tokens): two checkpoints with the same hash run the same computation."""
    text = json.dumps(asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dtype_name(dtype) -> str:
    """'bf16' / 'fp32' / 'fp16' from a torch dtype or a name."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return DTYPE_NAMES[name]


def model_fingerprint(config: ModelConfig, dtype: str, block_size: int) -> ModelFingerprint:
    return ModelFingerprint(
        architecture=config.architecture,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        dtype=dtype_name(dtype),
        block_size=block_size,
        config_hash=model_config_hash(config),
    )


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field (e.g. MemTotal, MemAvailable) in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_bytes() -> int:
    total = meminfo_bytes("MemTotal")
    if total is not None:
        return total
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
