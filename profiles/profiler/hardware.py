"""This machine's hardware fingerprint, as the profiler records it in a profile."""

from __future__ import annotations

import os

import torch

from dualpace.model import cpu_kernels
from dualpace.profile.fingerprint import cpu_model_name, memory_bytes
from dualpace.profile.schema import HardwareFingerprint


def hardware_fingerprint(threads: int, device: str, bandwidth_bytes_per_s: float | None = None) -> HardwareFingerprint:
    """This machine. `device` is where the GPU engine runs ('cuda:0', or 'cpu' when there is no
    GPU and the GPU engine runs on the CPU device)."""
    gpu_model = gpu_memory = None
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(torch.device(device))
        gpu_model, gpu_memory = properties.name, int(properties.total_memory)
    kernels = cpu_kernels.kernel_info()
    return HardwareFingerprint(
        cpu_model=cpu_model_name(),
        cpu_cores=os.cpu_count() or 1,
        memory_bytes=memory_bytes(),
        memory_bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        gpu_model=gpu_model,
        gpu_memory_bytes=gpu_memory,
        cpu_threads=threads,
        torch_version=torch.__version__,
        device=device,
        cpu_kernel_variant=kernels["variant"],
        cpu_flags=tuple(kernels["cpu_flags"]),
        cpu_amx=kernels["amx"],
    )
