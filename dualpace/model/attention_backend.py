"""Which implementation a step uses: Triton kernels or the torch ops they replace.

`DUALPACE_ATTENTION_BACKEND` (attention: dualpace.model.triton_attention or the gather path):
- `auto` (default): the Triton kernel on CUDA when Triton imports; the gather path (and the CPU
  engine's own kernels) everywhere else;
- `gather`: always the gather path (the reference the kernel is tested against);
- `triton`: always the kernel, also on CPU tensors, which needs `TRITON_INTERPRET=1` (tests).

`DUALPACE_FUSED_KERNELS` (RMSNorm with its residual add, and RoPE: dualpace.model.triton_fused or
the torch ops of dualpace.model.transformer): `auto` (default, Triton on CUDA), `torch` (always the
torch ops, or the CPU kernels on a CPU) or `triton` (also on CPU tensors, under the interpreter).
"""

from __future__ import annotations

import functools
import os

import torch

from dualpace.model.triton_attention import triton_importable

BACKENDS = ("auto", "gather", "triton")
ENV_VAR = "DUALPACE_ATTENTION_BACKEND"
FUSED_CHOICES = ("auto", "torch", "triton")
FUSED_ENV_VAR = "DUALPACE_FUSED_KERNELS"


def _choice(env_var: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(env_var, "auto").strip().lower() or "auto"
    if value not in choices:
        raise ValueError(f"{env_var}={value!r}: expected one of {', '.join(choices)}")
    return value


def chosen_backend() -> str:
    return _choice(ENV_VAR, BACKENDS)


@functools.cache
def _triton_available() -> bool:
    return triton_importable()


def _triton_for(env_var: str, value: str, device: torch.device) -> bool:
    """Whether `value` (auto, triton or the torch alternative) means Triton on `device`."""
    if value == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{env_var}=triton on {device.type} tensors needs TRITON_INTERPRET=1")
        if not _triton_available():
            raise ValueError(f"{env_var}=triton but triton is not installed")
        return True
    return value == "auto" and device.type == "cuda" and _triton_available()


def uses_triton(device: torch.device) -> bool:
    """Attention through the paged Triton kernel on `device`."""
    return _triton_for(ENV_VAR, chosen_backend(), device)


def uses_fused_triton(device: torch.device) -> bool:
    """RMSNorm and RoPE through the fused Triton kernels on `device`."""
    return _triton_for(FUSED_ENV_VAR, _choice(FUSED_ENV_VAR, FUSED_CHOICES), device)
