"""Which attention implementation a step uses: the paged Triton kernel or the gather path.

`DUALPACE_ATTENTION_BACKEND`:
- `auto` (default): the Triton kernel on CUDA when Triton imports; the gather path (and the CPU
  engine's own kernels) everywhere else;
- `gather`: always the gather path (the reference the kernel is tested against);
- `triton`: always the kernel, also on CPU tensors, which needs `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import functools
import os

import torch

from dualpace.model.triton_attention import triton_importable

BACKENDS = ("auto", "gather", "triton")
ENV_VAR = "DUALPACE_ATTENTION_BACKEND"


def chosen_backend() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


@functools.cache
def _triton_available() -> bool:
    return triton_importable()


def uses_triton(device: torch.device) -> bool:
    backend = chosen_backend()
    if backend == "gather":
        return False
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{ENV_VAR}=triton on {device.type} tensors needs TRITON_INTERPRET=1")
        if not _triton_available():
            raise ValueError(f"{ENV_VAR}=triton but triton is not installed")
        return True
    return device.type == "cuda" and _triton_available()
