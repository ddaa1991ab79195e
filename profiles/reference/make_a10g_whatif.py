"""Build the WHAT-IF profile a10g_epyc_avx2_llama3_8b_whatif.json by scaling the reference H100
profile (a KV-bound set-up: an AWS g5-like box, one A10G 24 GB and an AVX2 EPYC host).

    python -m profiles.reference.make_a10g_whatif   # rewrites the JSON beside this file

Not measured and not even a roofline of its own: every table of the H100 profile is multiplied
by a ratio of published peaks (sources and the assumptions each ratio carries are in
a10g_epyc_avx2_llama3_8b_whatif.md). A profile measured on such a box replaces it.
"""

from __future__ import annotations

import json
from pathlib import Path

from dualpace.profile.files import parse_profile, save_profile
from profiles.reference import make_h100_reference as h100

HERE = Path(__file__).parent
SOURCE = HERE / "h100_sapphire_rapids_llama3_8b.json"
TARGET = HERE / "a10g_epyc_avx2_llama3_8b_whatif.json"

# ---- GPU: NVIDIA A10 datasheet figures, used for the A10G (AWS publishes no tensor peak for it)
A10G_GDDR6_BYTES_PER_S = 600e9
A10G_BF16_FLOPS = 125e12  # dense
A10G_MEMORY_BYTES = 24 * 2**30
A10G_ACTIVATION_RESERVE_BYTES = 2e9  # scaling assumption: half the H100's 4 GB
GPU_MEMORY_BOUND_SCALE = h100.HBM_BYTES_PER_S / A10G_GDDR6_BYTES_PER_S  # 5.58: decode, assist
GPU_PREFILL_SCALE = h100.GPU_BF16_FLOPS / A10G_BF16_FLOPS  # 7.91: prefill (compute-bound)

# ---- host: AWS g5 = 2nd-generation AMD EPYC (AVX2, no AVX-512, no AMX)
HOST_ACHIEVED_BYTES_PER_S = 150e9  # scaling assumption: one socket, 8 x DDR4-3200 = 204.8 GB/s peak
HOST_SCALE = h100.DDR_BYTES_PER_S / HOST_ACHIEVED_BYTES_PER_S  # 4.10: every host table
HOST_KV_BYTES = 150e9  # scaling assumption: g5.12xlarge has 192 GiB; the rest is weights, OS, buffers

# ---- link: PCIe Gen4 x16 (32 GB/s raw per direction)
PCIE_GEN4_BYTES_PER_S = 25e9  # scaling assumption: half the Gen5 figure the H100 profile uses

GPU_TABLES = {"gpu_decode_ms": GPU_MEMORY_BOUND_SCALE, "assist_ms": GPU_MEMORY_BOUND_SCALE,
              "gpu_prefill_ms": GPU_PREFILL_SCALE}
HOST_TABLES = ("cpu_dense_ms", "cpu_attention_ms", "lm_head_sampling_ms")


def _scaled(values, factor: float):
    if isinstance(values, list):
        return [_scaled(v, factor) for v in values]
    return round(values * factor, 4)


def build() -> dict:
    data = json.loads(SOURCE.read_text())
    data.pop("profiler", None)  # the H100 box's figures and features; this what-if's are in its .md
    tables = data["tables"]
    for name, factor in GPU_TABLES.items():
        tables[name]["ms"] = _scaled(tables[name]["ms"], factor)
    for name in HOST_TABLES:
        tables[name]["ms"] = _scaled(tables[name]["ms"], HOST_SCALE)
    bytes_per_block = data["capacities"]["bytes_per_block"]
    weights_bytes = (h100.DENSE_PARAMS + 2 * h100.LM_HEAD_PARAMS) * h100.DTYPE_BYTES
    gpu_kv_bytes = A10G_MEMORY_BYTES * h100.GPU_MEMORY_UTILIZATION - weights_bytes - A10G_ACTIVATION_RESERVE_BYTES
    data["capacities"].update(gpu_kv_blocks=int(gpu_kv_bytes // bytes_per_block),
                              cpu_kv_blocks=int(HOST_KV_BYTES // bytes_per_block))
    data["kv_transfer"]["bytes_per_s"] = PCIE_GEN4_BYTES_PER_S
    data["hardware"] = {"cpu_model": "AMD EPYC 2nd gen (AWS g5-like, AVX2) - what-if", "cpu_cores": 48,
                        "memory_bytes": 192 * 2**30, "memory_bandwidth_bytes_per_s": HOST_ACHIEVED_BYTES_PER_S,
                        "gpu_model": "NVIDIA A10G 24GB (what-if, scaled)", "gpu_memory_bytes": A10G_MEMORY_BYTES}
    data["notes"] = ("WHAT-IF, not measured: the H100 reference profile scaled by ratios of published peaks "
                     "by profiles/reference/make_a10g_whatif.py; sources and assumptions in "
                     "a10g_epyc_avx2_llama3_8b_whatif.md. " + h100.assumed_engine_note(PCIE_GEN4_BYTES_PER_S))
    parse_profile(data)  # validate
    return data


def main() -> None:
    save_profile(parse_profile(build()), TARGET)
    print(f"wrote {TARGET}")


if __name__ == "__main__":
    main()
