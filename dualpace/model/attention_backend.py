"""Which implementation a step uses: Triton kernels or the torch ops they replace.

Attention (`attention_backend`: dualpace.model.triton_attention or the gather path):
- `auto` (default): the Triton kernel on CUDA when Triton imports; the gather path (and the CPU
  engine's own kernels) everywhere else;
- `gather`: always the gather path (the reference the kernel is tested against);
- `triton`: always the kernel, also on CPU tensors, which needs `TRITON_INTERPRET=1` (tests).

RMSNorm with its residual add, and RoPE (`fused_kernels`: dualpace.model.triton_fused or the torch
ops of dualpace.model.transformer): `auto` (default, Triton on CUDA), `torch` (always the torch
ops, or the CPU kernels on a CPU) or `triton` (also on CPU tensors, under the interpreter).

One choice per process (`configure`): the engine daemons set it from --attention-backend and
--fused-kernels before they load the model; everything else runs `auto`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from dualpace.model.triton_attention import triton_importable

ATTENTION_BACKENDS = ("auto", "gather", "triton")
FUSED_KERNELS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelChoices:
    attention_backend: str = "auto"
    fused_kernels: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in (("attention_backend", ATTENTION_BACKENDS), ("fused_kernels", FUSED_KERNELS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(choices)}")


_chosen = KernelChoices()


def configure(choices: KernelChoices) -> None:
    """This process's choice, from now on (a model loaded before keeps its fused-kernel choice)."""
    global _chosen
    _chosen = choices


def chosen() -> KernelChoices:
    return _chosen


@functools.cache
def _triton_available() -> bool:
    return triton_importable()


def _triton_for(name: str, value: str, device: torch.device) -> bool:
    """Whether `value` (auto, triton or the torch alternative) means Triton on `device`."""
    if value == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{name}=triton on {device.type} tensors needs TRITON_INTERPRET=1")
        if not _triton_available():
            raise ValueError(f"{name}=triton but triton is not installed")
        return True
    return value == "auto" and device.type == "cuda" and _triton_available()


def uses_triton(device: torch.device, choices: KernelChoices | None = None) -> bool:
    """Attention through the paged Triton kernel on `device` (under `choices`, default this process's)."""
    return _triton_for("attention_backend", (choices or _chosen).attention_backend, device)


def uses_fused_triton(device: torch.device) -> bool:
    """RMSNorm and RoPE through the fused Triton kernels on `device`."""
    return _triton_for("fused_kernels", _chosen.fused_kernels, device)
