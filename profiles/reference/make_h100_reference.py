"""The H100 box of the reference profiles: published figures and the assumed engine (see
h100_sapphire_rapids_llama3_8b.md for every number's source).

    python -m profiles.reference.reference_profiles   # rewrites its JSON files (and the others')

Pure arithmetic: nothing is measured. Every latency is a roofline (roofline.py): max(bytes /
achieved bandwidth, FLOPs / achieved compute) + a fixed per-iteration overhead. This module holds
the H100 box's figures; reference_profiles.py builds its two variants (assumed engine, measured
overheads) beside the A10G and L4 profiles.
"""

from __future__ import annotations

# ---- model: Llama-3-8B, shared by every reference profile (roofline.py); re-exported for make_a10g_whatif
from profiles.reference.roofline import (  # noqa: F401
    DENSE_PARAMS,
    DTYPE_BYTES,
    LM_HEAD_PARAMS,
    EngineCosts,
    Gpu,
    Host,
    Roofline,
)

# ---- GPU: one H100 SXM5 80 GB (NVIDIA H100 datasheet)
HBM_BYTES_PER_S = 3.35e12
GPU_BF16_FLOPS = 989e12  # dense (no sparsity)
GPU_MEM_EFFICIENCY = 0.80  # achieved / peak HBM bandwidth when streaming weights and KV
GPU_COMPUTE_EFFICIENCY = 0.50  # achieved / peak bf16 for prefill GEMMs + attention (MFU)
GPU_ITERATION_OVERHEAD_MS = 1.0  # host-side scheduling + launch per iteration (CUDA graphs for decode)
GPU_MEMORY_BYTES = 80 * 2**30
GPU_MEMORY_UTILIZATION = 0.90  # the vLLM default share of device memory the engine may use
GPU_ACTIVATION_RESERVE_BYTES = 4e9  # activations, CUDA graphs, allocator slack

# ---- CPU: 2 x Xeon Platinum 8480+ (Sapphire Rapids, 56 cores each; Intel ARK / SPR specs)
SOCKETS, CORES_PER_SOCKET = 2, 56
DDR_BYTES_PER_S = SOCKETS * 8 * 4800e6 * 8  # 8 channels DDR5-4800 x 8 bytes per socket = 307.2 GB/s each
CPU_MEM_EFFICIENCY = 0.70  # STREAM-like achieved share across both sockets (NUMA-aware placement)
CPU_ATTN_MEM_EFFICIENCY = 0.60  # paged KV reads: scattered 2 MiB blocks, softmax passes
AMX_BF16_FLOPS_PER_CYCLE = 1024  # per core (AMX TMUL, bf16)
AMX_GHZ = 1.9  # all-core frequency under AMX load (below the 2.0 GHz base)
CPU_BF16_FLOPS = SOCKETS * CORES_PER_SOCKET * AMX_BF16_FLOPS_PER_CYCLE * AMX_GHZ * 1e9  # 218 TFLOP/s peak
CPU_COMPUTE_EFFICIENCY = 0.25  # oneDNN AMX GEMMs at decode shapes, both sockets
CPU_ITERATION_OVERHEAD_MS = 2.0  # per-layer thread synchronisation + Python per iteration
CPU_ATTN_LAYER_OVERHEAD_MS = 0.02  # per layer: kernel launch over the batch
HOST_MEMORY_BYTES = 512 * 2**30  # 16 x 32 GB DDR5 RDIMMs (one per channel)
HOST_KV_BYTES = 400e9  # host memory given to the CPU engine's KV (the rest: weights copy, OS, buffers)

# ---- link and Dense Assist
PCIE_BYTES_PER_S = 50e9  # PCIe Gen5 x16: 64 GB/s per direction raw, ~50 GB/s effective
KV_TRANSFER_FIXED_MS = 1.0  # per transfer: pause at a step boundary, commit, stream setup
ASSIST_ROUND_TRIP_MS = 0.15  # per layer: one request/reply on a same-host stream (profiled in practice)



# Engine features these tables assume that the code does not have yet (the .md's section
# "Engine features assumed vs built" gives the measured figures and their sources).
def assumed_engine_note(kv_transfer_bytes_per_s: float) -> str:
    return ("ASSUMES, NOT YET BUILT: CUDA graphs for decode (1 ms per iteration; the code runs eager ops), "
            "flash-style paged attention at 80% of HBM bandwidth (a Triton kernel exists, never run on a GPU), "
            f"a {kv_transfer_bytes_per_s / 1e9:g} GB/s DMA KV transfer (measured gRPC ImportKv: 0.76-0.96 GB/s "
            "plus 15-24 ms per transfer), 0.15 ms Dense Assist round trips per layer (measured: 0.3-0.7 ms).")


H100_SXM = Gpu("NVIDIA H100 80GB HBM3 (SXM5)", HBM_BYTES_PER_S, GPU_BF16_FLOPS, GPU_MEMORY_BYTES,
               GPU_ACTIVATION_RESERVE_BYTES, GPU_MEM_EFFICIENCY, GPU_COMPUTE_EFFICIENCY, GPU_MEMORY_UTILIZATION)
SPR_2S_HOST = Host("2x Intel Xeon Platinum 8480+ (Sapphire Rapids)", SOCKETS * CORES_PER_SOCKET, HOST_MEMORY_BYTES,
                   DDR_BYTES_PER_S, CPU_BF16_FLOPS, HOST_KV_BYTES, CPU_MEM_EFFICIENCY, CPU_ATTN_MEM_EFFICIENCY,
                   CPU_COMPUTE_EFFICIENCY, CPU_ITERATION_OVERHEAD_MS, CPU_ATTN_LAYER_OVERHEAD_MS)
ASSUMED_ENGINE = EngineCosts(GPU_ITERATION_OVERHEAD_MS, 0.0, PCIE_BYTES_PER_S, PCIE_BYTES_PER_S, KV_TRANSFER_FIXED_MS,
                             ASSIST_ROUND_TRIP_MS)
ROOFLINE = Roofline(H100_SXM, SPR_2S_HOST, ASSUMED_ENGINE)
HARDWARE = {"cpu_model": SPR_2S_HOST.name, "cpu_cores": SPR_2S_HOST.cores, "memory_bytes": HOST_MEMORY_BYTES,
            "memory_bandwidth_bytes_per_s": DDR_BYTES_PER_S, "gpu_model": H100_SXM.name,
            "gpu_memory_bytes": GPU_MEMORY_BYTES}

