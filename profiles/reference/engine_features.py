"""What each reference profile assumes of the engine, and what this code has (stored in the
profile's "profiler" object as "engine_features", and summarised in its notes).

Each feature is a dict: feature (a stable key), assumed (what the "assumed" variant's tables
take), status ("not built", "built", or "built, <qualifier>"), code_today (what the code has
and where the figure comes from), measured_variant (what the "measured overheads" variant uses
instead). The measured figures are the code's own: MEASURED below, one place for all profiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpace.policy.migration_planner import MEASURED_KV_TRANSFER_BYTES_PER_S, MEASURED_KV_TRANSFER_FIXED_MS

REQUIRED_FEATURES = ("cuda_graphs", "gpu_engine_loop", "flash_attention", "kv_transfer", "assist_round_trip",
                     "cpu_dense_kernels")


@dataclass(frozen=True)
class MeasuredOverheads:
    """The code's measured overheads (sources in each feature's code_today)."""

    # The router's no-profile KV price, slower than every path measured (shared memory on one host,
    # the TCP data socket between hosts or into a CUDA pool): a conservative bound
    kv_transfer_bytes_per_s: float = MEASURED_KV_TRANSFER_BYTES_PER_S
    kv_transfer_fixed_ms: float = MEASURED_KV_TRANSFER_FIXED_MS
    assist_round_trip_ms: float = 0.166  # shared-memory ring (the default on one host), p50 at batch 8
    eager_ops_per_layer: int = 60  # torch ops per decode layer (torch profiler of PagedForward)
    launch_us_per_op: float = 10.0  # CPU-side CUDA launch, middle of the 5-20 us range (HTA docs)
    engine_loop_overhead_ms: float = 1.9  # engine loop per iteration (from gpu_service's CPU time)

    @property
    def launch_ms_per_layer(self) -> float:
        return self.eager_ops_per_layer * self.launch_us_per_op / 1000.0


MEASURED = MeasuredOverheads()


def features(*, kv_transfer_bytes_per_s: float, assumed_round_trip_ms: float, avx2_host: bool) -> list[dict]:
    m = MEASURED
    cpu_dense = (
        {"feature": "cpu_dense_kernels",
         "assumed": "bf16 weights streamed by an AVX2 GEMV (converted in registers), fp32 FMA at 50% of the AVX2 "
                    "peak for larger batches",
         "status": "built, up to 32 rows",
         "code_today": "the avx2 variant of dualpace/model/cpu_kernels.cpp streams bf16 weights for up to 32 rows "
                       "(MIXED_MAX_ROWS); beyond, the matrix is widened to fp32 per call for oneDNN, slower than "
                       "this roofline assumes",
         "measured_variant": "same tables (no measurement of this code on such a host)"}
        if avx2_host else
        {"feature": "cpu_dense_kernels",
         "assumed": "AMX bf16 GEMMs at 25% of peak",
         "status": "not built",
         "code_today": "the decode GEMVs are AVX512-BF16 (dualpace/model/cpu_kernels.cpp); nothing asks for AMX "
                       "tiles (oneDNN may use them inside torch for large GEMMs; KERNELS.md)",
         "measured_variant": "same tables (no AMX machine measured)"})
    return [
        {"feature": "cuda_graphs",
         "assumed": "decode iterations replay CUDA graphs: no per-op launch cost on the host",
         "status": "not built",
         "code_today": f"eager PyTorch ops, about {m.eager_ops_per_layer} per layer (torch profiler of "
                       f"PagedForward.forward), each launched from the host; CPU-side launch is 5-20 us per "
                       f"kernel (Holistic Trace Analysis docs, 'CUDA kernel launch stats')",
         "measured_variant": f"a layer cannot finish before the host has issued it: {m.eager_ops_per_layer} ops x "
                             f"{m.launch_us_per_op:g} us = {m.launch_ms_per_layer:g} ms per layer is a floor of "
                             f"every GPU table and of each assist stage"},
        {"feature": "gpu_engine_loop",
         "assumed": "1.0 ms of host scheduling per GPU iteration",
         "status": "built, measured on the CPU device only",
         "code_today": f"{m.engine_loop_overhead_ms:g} ms per iteration (schedule, apply, executor hop, token "
                       f"streaming), from gpu_service's CPU time in the gpu-only validation runs (docs/results.md, "
                       f"'Simulator vs real')",
         "measured_variant": f"{m.engine_loop_overhead_ms:g} ms per GPU iteration"},
        {"feature": "flash_attention",
         "assumed": "paged attention reading the KV blocks in place at 80% of the GPU's memory bandwidth",
         "status": "built, never run on a GPU",
         "code_today": "the Triton paged kernel (dualpace/model/triton_attention.py), tested under Triton's "
                       "interpreter on CPU tensors; its speed on a GPU is unmeasured (docs/perf.md, GPU engine)",
         "measured_variant": "same KV term (no measurement exists)"},
        {"feature": "kv_transfer",
         "assumed": f"KV moved by PCIe DMA at {kv_transfer_bytes_per_s / 1e9:g} GB/s + 1 ms per transfer",
         "status": "not built",
         "code_today": f"priced at the router's no-profile bound, {m.kv_transfer_bytes_per_s / 1e9:g} GB/s + "
                       f"{m.kv_transfer_fixed_ms:g} ms, slower than every transfer measured "
                       f"(MEASURED_KV_TRANSFER_* in dualpace/policy/migration_planner.py); the transfer takes "
                       f"shared memory on one host (2.21 GB/s at 1024 tokens on a quiet 2-core Xeon, docs/perf.md; "
                       f"from a CUDA pool, unmeasured) and the TCP data socket between hosts "
                       f"or into a CUDA pool (1.13 GB/s over loopback, same run)",
         "measured_variant": f"{m.kv_transfer_bytes_per_s / 1e9:g} GB/s + {m.kv_transfer_fixed_ms:g} ms"},
        {"feature": "assist_round_trip",
         "assumed": f"{assumed_round_trip_ms:g} ms per layer",
         "status": "built, measured only on a loaded 2-core host",
         "code_today": f"shared-memory rings (the default on one host): p50 141-178 us per layer at batch 1-32, "
                       f"load 14 (docs/perf.md, bench.assist_rtt); gRPC 1.6-1.8 ms in the same run",
         "measured_variant": f"{m.assist_round_trip_ms:g} ms per layer (the shm p50 at batch 8)"},
        cpu_dense,
    ]


def features_note(feature_list: list[dict], variant: str) -> str:
    """One line per profile: which assumptions are not built, and what the variant uses."""
    missing = [f["feature"] for f in feature_list if f["status"] == "not built"]
    unverified = [f["feature"] for f in feature_list if f["status"].startswith("built,")]
    head = ("ASSUMED ENGINE" if variant == "assumed" else
            "MEASURED OVERHEADS (the code's figures in place of: cuda_graphs, gpu_engine_loop, kv_transfer, "
            "assist_round_trip)")
    return (f"{head}. NOT YET BUILT: {', '.join(missing)}. Built but unverified at this scale: {', '.join(unverified)}. "
            "Details and sources: profiler.engine_features.")
