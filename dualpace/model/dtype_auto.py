"""What `--dtype auto` means on this machine: the compute dtype, and the dtype of dense matrices.

On a GPU, and on a CPU with native bf16 arithmetic (AVX512_BF16, AMX-BF16, aarch64 BF16),
everything is bf16: decode is memory-bound and bf16 halves the bytes read per step, and bf16
GEMMs run at full speed. On a CPU without native bf16, torch emulates bf16 matmuls: a 513-token
prefill took 16.2 s in bf16 and 1.7 s in fp32 on an AVX2 Zen 3. There the
compute dtype (activations, norms, KV cache) is fp32, and dense matrices stay bf16 when the CPU
kernels are on: their GEMV widens bf16 weights in registers, so a decode step streams half the
bytes of fp32 weights, and a prefill converts each matrix to fp32 once per step for oneDNN (a
batch-1 step 1.83x faster than with fp32 matrices, a 512-token prefill 3% slower). Without the
kernels the matrices are fp32 too (torch would convert them on every decode step).

The decision depends only on the device kind, the CPU flags and whether the kernels load; it is
logged once per process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 / AMX, aarch64 FEAT_BF16


@dataclass(frozen=True)
class AutoDtypes:
    compute: torch.dtype  # activations, norms, bias, KV cache
    matrices: torch.dtype  # dense weight matrices (projections, embedding, LM head)
    reason: str


def decide(device_type: str, cpu_flags: frozenset[str], kernels_on: bool) -> AutoDtypes:
    """The rule, as a function of what was detected (no detection here)."""
    if device_type != "cpu":
        return AutoDtypes(torch.bfloat16, torch.bfloat16, f"{device_type}: bf16 compute and weights")
    native = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags)
    if native:
        return AutoDtypes(torch.bfloat16, torch.bfloat16, f"CPU has native bf16 ({', '.join(native)}): bf16")
    if kernels_on:
        return AutoDtypes(torch.float32, torch.bfloat16,
                          "CPU has no native bf16 (torch would emulate bf16 matmuls): fp32 compute, bf16 matrices "
                          "(the CPU kernels' GEMV widens them in registers: half the bytes per decode step)")
    return AutoDtypes(torch.float32, torch.float32,
                      "CPU has no native bf16 and the CPU kernels are off: fp32 compute and weights")


_logged: set[AutoDtypes] = set()


def auto_dtypes(device_type: str) -> AutoDtypes:
    """The decision for this process's CPU (or a GPU), logged the first time it is made."""
    if device_type == "cpu":
        from dualpace.model import cpu_kernels
        from dualpace.model.cpu_kernels_build import cpu_flags

        choice = decide("cpu", cpu_flags(), cpu_kernels.get() is not None)
    else:
        choice = decide(device_type, frozenset(), False)
    if choice not in _logged:
        _logged.add(choice)
        log.info("--dtype auto: %s", choice.reason)
    return choice
