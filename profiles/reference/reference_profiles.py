"""Build every reference profile: three boxes x two engine variants, one roofline (roofline.py).

    python -m profiles.reference.reference_profiles   # rewrites the six JSON files beside this file

Boxes (every figure's source in `figures`, stored in the profile's profiler.figures, and in the
box's .md):
- h100_sapphire_rapids_llama3_8b: one H100 SXM5 80 GB + 2 x Xeon 8480+ (make_h100_reference.py)
- a10g_epyc_avx2_llama3_8b: one A10G 24 GB + an AVX2 EPYC 7R32 host (an AWS g5.16xlarge-like box)
- l4_sapphire_rapids_llama3_8b: one L4 24 GB + 1 x Xeon 8480+

Variants: the plain name takes the engine the design assumes (CUDA graphs, 1 ms per iteration,
PCIe DMA KV transfer, 0.15 ms assist round trips); `_measured_overheads` takes the code's
measured figures instead (engine_features.MEASURED: eager launches, the engine loop, gRPC KV
transfer, shared-memory round trips). The GPU and host figures are the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dualpace.profile.files import parse_profile, save_profile
from profiles.reference import make_h100_reference as h100
from profiles.reference.engine_features import MEASURED, features, features_note
from profiles.reference.roofline import EngineCosts, Gpu, Host, Roofline

HERE = Path(__file__).parent
ASSUMED_FIXED_MS, ASSUMED_ROUND_TRIP_MS, ASSUMED_ITERATION_MS = 1.0, 0.15, 1.0
PCIE_GEN4_BYTES_PER_S = 25e9  # Gen4 x16: 32 GB/s raw per direction; ~25 GB/s effective DMA (assumption)
MEASURED_SUFFIX = "_measured_overheads"


@dataclass(frozen=True)
class Box:
    name: str
    gpu: Gpu
    host: Host
    pcie_bytes_per_s: float
    avx2_host: bool
    doc: str  # the .md beside the JSON with every figure's source
    figures: tuple[tuple[str, str, str], ...]  # (quantity, value, source)


_SPR_ARK = "Intel ARK, Xeon Platinum 8480+ (56 cores, 8 channels DDR5-4800)"
_AMX = "Intel AMX: 1024 bf16 FLOP per cycle per core (TMUL); 1.9 GHz all-core under AMX is an assumption"
H100_BOX = Box(
    "h100_sapphire_rapids_llama3_8b", h100.H100_SXM, h100.SPR_2S_HOST, h100.PCIE_BYTES_PER_S, False,
    "h100_sapphire_rapids_llama3_8b.md",
    (("gpu memory bandwidth", "3.35 TB/s HBM3", "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
     ("gpu bf16 dense", "989 TFLOP/s", "NVIDIA H100 datasheet (1979 with sparsity)"),
     ("gpu memory", "80 GB", "NVIDIA H100 datasheet"),
     ("host", "2 x 56 cores, 16 x DDR5-4800 = 614.4 GB/s peak", _SPR_ARK),
     ("host bf16 peak", "218 TFLOP/s", _AMX),
     ("link", "PCIe Gen5 x16, 64 GB/s raw per direction, 50 GB/s effective (assumption)", "PCI-SIG Gen5 spec")))

A10G_GPU = Gpu("NVIDIA A10G 24GB (AWS g5)", 600e9, 125e12, 24 * 2**30, 2e9)
EPYC_7R32_HOST = Host(
    "AMD EPYC 7R32 (2nd gen, AVX2), 32 cores (AWS g5.16xlarge-like)", 32, 256 * 2**30,
    8 * 3200e6 * 8,  # one socket's 8 channels of DDR4-3200
    32 * 32 * 3.0e9,  # 32 cores x 32 fp32 FLOP/cycle (two 256-bit FMA pipes) x 3.0 GHz all-core
    200e9, compute_efficiency=0.50)
A10G_BOX = Box(
    "a10g_epyc_avx2_llama3_8b", A10G_GPU, EPYC_7R32_HOST, PCIE_GEN4_BYTES_PER_S, True,
    "a10g_epyc_avx2_llama3_8b.md",
    (("gpu memory bandwidth", "600 GB/s GDDR6", "NVIDIA A10 datasheet (AWS publishes no A10G sheet; same GA102 board)"),
     ("gpu bf16 dense", "125 TFLOP/s", "NVIDIA A10 datasheet (250 with sparsity); assumption that the A10G matches"),
     ("gpu memory", "24 GB", "AWS g5 instance page; NVIDIA A10 datasheet"),
     ("host", "AMD EPYC 7R32, 2nd gen, up to 3.3 GHz; g5.16xlarge: 1 GPU, 64 vCPUs (32 cores), 256 GiB",
      "AWS EC2 G5 instance page"),
     ("host bandwidth", "8 x DDR4-3200 = 204.8 GB/s peak", "AMD EPYC 7002 series specs (8 channels DDR4-3200); "
      "assumption that the instance gets one socket's channels (AWS does not publish it)"),
     ("host fp32 peak", "3.07 TFLOP/s", "Zen 2: two 256-bit FMA pipes per core = 32 fp32 FLOP/cycle (AMD Zen 2 "
      "microarchitecture); 3.0 GHz all-core is an assumption; no AVX-512, no AMX, no bf16 arithmetic"),
     ("link", "PCIe Gen4 x16, 32 GB/s raw per direction, 25 GB/s effective (assumption)", "PCI-SIG Gen4 spec")))

L4_GPU = Gpu("NVIDIA L4 24GB", 300e9, 121e12, 24 * 2**30, 2e9)
SPR_1S_HOST = Host(
    "1x Intel Xeon Platinum 8480+ (Sapphire Rapids)", 56, 256 * 2**30, 8 * 4800e6 * 8, 56 * 1024 * 1.9e9, 200e9)
L4_BOX = Box(
    "l4_sapphire_rapids_llama3_8b", L4_GPU, SPR_1S_HOST, PCIE_GEN4_BYTES_PER_S, False,
    "l4_sapphire_rapids_llama3_8b.md",
    (("gpu memory bandwidth", "300 GB/s GDDR6", "NVIDIA L4 Tensor Core GPU datasheet"),
     ("gpu bf16 dense", "121 TFLOP/s", "NVIDIA L4 datasheet (242 with sparsity)"),
     ("gpu memory", "24 GB", "NVIDIA L4 datasheet"),
     ("host", "1 x 56 cores, 8 x DDR5-4800 = 307.2 GB/s peak, 8 x 32 GB", _SPR_ARK),
     ("host bf16 peak", "109 TFLOP/s", _AMX),
     ("link", "PCIe Gen4 x16 (L4 datasheet), 25 GB/s effective (assumption)", "NVIDIA L4 datasheet; PCI-SIG")))

BOXES = {box.name: box for box in (H100_BOX, A10G_BOX, L4_BOX)}
PROFILE_NAMES = tuple(name + suffix for name in BOXES for suffix in ("", MEASURED_SUFFIX))


def _engine(box: Box, measured: bool) -> EngineCosts:
    if measured:
        return EngineCosts(MEASURED.engine_loop_overhead_ms, MEASURED.launch_ms_per_layer, box.pcie_bytes_per_s,
                           MEASURED.kv_transfer_bytes_per_s, MEASURED.kv_transfer_fixed_ms, MEASURED.assist_round_trip_ms)
    return EngineCosts(ASSUMED_ITERATION_MS, 0.0, box.pcie_bytes_per_s, box.pcie_bytes_per_s, ASSUMED_FIXED_MS,
                       ASSUMED_ROUND_TRIP_MS)


def build(name: str) -> dict:
    """The profile `name` (one of PROFILE_NAMES) as a JSON-ready dict, validated."""
    if name not in PROFILE_NAMES:
        raise ValueError(f"unknown reference profile {name!r}; expected one of {', '.join(PROFILE_NAMES)}")
    measured = name.endswith(MEASURED_SUFFIX)
    box = BOXES[name.removesuffix(MEASURED_SUFFIX)]
    variant = "measured_overheads" if measured else "assumed"
    feature_list = features(kv_transfer_bytes_per_s=box.pcie_bytes_per_s, assumed_round_trip_ms=ASSUMED_ROUND_TRIP_MS,
                            avx2_host=box.avx2_host)
    hardware = {"cpu_model": box.host.name, "cpu_cores": box.host.cores, "memory_bytes": box.host.memory_bytes,
                "memory_bandwidth_bytes_per_s": box.host.memory_bytes_per_s, "gpu_model": box.gpu.name,
                "gpu_memory_bytes": box.gpu.memory_bytes}
    notes = (f"REFERENCE, not measured: roofline tables from published figures by "
             f"profiles/reference/reference_profiles.py; every figure's source in {box.doc} and profiler.figures. "
             + features_note(feature_list, variant))
    profiler = {"tool": "profiles/reference/reference_profiles.py", "kind": "reference roofline, not measured",
                "variant": variant, "doc": box.doc,
                "figures": [{"quantity": q, "value": v, "source": s} for q, v, s in box.figures],
                "engine_features": feature_list}
    data = Roofline(box.gpu, box.host, _engine(box, measured)).profile_dict(hardware, notes, profiler)
    parse_profile(data)  # validate
    return data


def path_of(name: str) -> Path:
    return HERE / f"{name}.json"


def main() -> None:
    for name in PROFILE_NAMES:
        save_profile(parse_profile(build(name)), path_of(name))
        print(f"wrote {path_of(name)}")


if __name__ == "__main__":
    main()
