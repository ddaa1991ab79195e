"""Build the reference profile h100_sapphire_rapids_llama3_8b.json from published figures and
first-principles formulas (see h100_sapphire_rapids_llama3_8b.md for every number's source).

    python -m profiles.reference.make_h100_reference   # rewrites the JSON beside this file

Pure arithmetic: nothing is measured. Every latency is a roofline: max(bytes / achieved
bandwidth, FLOPs / achieved compute) + a fixed per-iteration overhead.
"""

from __future__ import annotations

from pathlib import Path

from dualpace.profile.files import parse_profile, save_profile

# ---- model: Llama-3-8B (Meta Llama 3 model card / config.json)
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FFN = 32, 4096, 32, 8, 128, 128256, 14336
DTYPE_BYTES, BLOCK_SIZE = 2, 16
LAYER_PARAMS = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * FFN
DENSE_PARAMS = LAYERS * LAYER_PARAMS  # 6.98e9: QKV + O + gate/up/down of every layer
LM_HEAD_PARAMS = VOCAB * HIDDEN  # 0.525e9 (untied; the embedding lookup reads only B rows)
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 131072 = 128 KiB

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

GPU_PREFILL_TOKENS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
CONTEXTS = [128, 512, 1024, 2048, 4096, 8192, 16384, 32768]


# Engine features these tables assume that the code does not have yet (the .md's section
# "Engine features assumed vs built" gives the measured figures and their sources).
def assumed_engine_note(kv_transfer_bytes_per_s: float) -> str:
    return ("ASSUMES, NOT YET BUILT: CUDA graphs for decode (1 ms per iteration; the code runs eager ops), "
            "flash-style paged attention (the GPU path gathers the blocks into a dense copy), "
            f"a {kv_transfer_bytes_per_s / 1e9:g} GB/s DMA KV transfer (measured gRPC ImportKv: 0.76-0.96 GB/s "
            "plus 15-24 ms per transfer), 0.15 ms Dense Assist round trips per layer (measured: 0.3-0.7 ms).")


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


def gpu_prefill_ms(tokens: int) -> float:
    weights = (DENSE_PARAMS + LM_HEAD_PARAMS) * DTYPE_BYTES
    flops = 2 * DENSE_PARAMS * tokens + 2 * LM_HEAD_PARAMS + 2 * LAYERS * tokens * tokens * HEADS * HEAD_DIM
    seconds = max(weights / (HBM_BYTES_PER_S * GPU_MEM_EFFICIENCY), flops / (GPU_BF16_FLOPS * GPU_COMPUTE_EFFICIENCY))
    return round(_ms(seconds) + GPU_ITERATION_OVERHEAD_MS, 4)


def gpu_decode_ms(batch: int, context: int) -> float:
    num_bytes = (DENSE_PARAMS + LM_HEAD_PARAMS) * DTYPE_BYTES + batch * context * KV_BYTES_PER_TOKEN
    flops = 2 * (DENSE_PARAMS + LM_HEAD_PARAMS) * batch + 4 * LAYERS * batch * context * HEADS * HEAD_DIM
    seconds = max(num_bytes / (HBM_BYTES_PER_S * GPU_MEM_EFFICIENCY), flops / (GPU_BF16_FLOPS * GPU_COMPUTE_EFFICIENCY))
    return round(_ms(seconds) + GPU_ITERATION_OVERHEAD_MS, 4)


def cpu_dense_ms(batch: int) -> float:
    seconds = max(DENSE_PARAMS * DTYPE_BYTES / (DDR_BYTES_PER_S * CPU_MEM_EFFICIENCY),
                  2 * DENSE_PARAMS * batch / (CPU_BF16_FLOPS * CPU_COMPUTE_EFFICIENCY))
    return round(_ms(seconds) + CPU_ITERATION_OVERHEAD_MS, 4)


def cpu_attention_ms(batch: int, context: int) -> float:
    seconds = batch * context * KV_BYTES_PER_TOKEN / (DDR_BYTES_PER_S * CPU_ATTN_MEM_EFFICIENCY)
    return round(_ms(seconds) + LAYERS * CPU_ATTN_LAYER_OVERHEAD_MS, 4)


def lm_head_sampling_ms(batch: int) -> float:
    seconds = max(LM_HEAD_PARAMS * DTYPE_BYTES / (DDR_BYTES_PER_S * CPU_MEM_EFFICIENCY),
                  2 * LM_HEAD_PARAMS * batch / (CPU_BF16_FLOPS * CPU_COMPUTE_EFFICIENCY))
    sampling = batch * VOCAB * 4 * 3 / (DDR_BYTES_PER_S * CPU_MEM_EFFICIENCY)  # fp32 logits: write, softmax, draw
    return _ms(seconds + sampling)


def assist_ms(batch: int) -> float:
    weights_s = (DENSE_PARAMS + LM_HEAD_PARAMS) * DTYPE_BYTES / (HBM_BYTES_PER_S * GPU_MEM_EFFICIENCY)
    compute_s = 2 * (DENSE_PARAMS + LM_HEAD_PARAMS) * batch / (GPU_BF16_FLOPS * GPU_COMPUTE_EFFICIENCY)
    per_layer_bytes = batch * ((HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM) * DTYPE_BYTES  # q,k,v down; attn up
    link_s = LAYERS * per_layer_bytes / PCIE_BYTES_PER_S
    return round(_ms(max(weights_s, compute_s) + link_s) + LAYERS * ASSIST_ROUND_TRIP_MS, 4)


def build() -> dict:
    gpu_kv_bytes = GPU_MEMORY_BYTES * GPU_MEMORY_UTILIZATION - (DENSE_PARAMS + 2 * LM_HEAD_PARAMS) * DTYPE_BYTES \
        - GPU_ACTIVATION_RESERVE_BYTES
    bytes_per_block = KV_BYTES_PER_TOKEN * BLOCK_SIZE
    data = {
        "version": 1,
        "hardware": {
            "cpu_model": "2x Intel Xeon Platinum 8480+ (Sapphire Rapids)",
            "cpu_cores": SOCKETS * CORES_PER_SOCKET,
            "memory_bytes": HOST_MEMORY_BYTES,
            "memory_bandwidth_bytes_per_s": DDR_BYTES_PER_S,
            "gpu_model": "NVIDIA H100 80GB HBM3 (SXM5)",
            "gpu_memory_bytes": GPU_MEMORY_BYTES,
        },
        "model": {"architecture": "llama", "num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": HEADS,
                  "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "dtype": "bf16",
                  "block_size": BLOCK_SIZE},
        "tables": {
            "gpu_prefill_ms": {"tokens": GPU_PREFILL_TOKENS, "ms": [gpu_prefill_ms(t) for t in GPU_PREFILL_TOKENS]},
            "gpu_decode_ms": {"batch": BATCHES, "context_tokens": CONTEXTS,
                              "ms": [[gpu_decode_ms(b, c) for c in CONTEXTS] for b in BATCHES]},
            "cpu_dense_ms": {"batch": BATCHES, "ms": [cpu_dense_ms(b) for b in BATCHES]},
            "cpu_attention_ms": {"batch": BATCHES, "context_tokens": CONTEXTS,
                                 "ms": [[cpu_attention_ms(b, c) for c in CONTEXTS] for b in BATCHES]},
            "assist_ms": {"batch": BATCHES, "ms": [assist_ms(b) for b in BATCHES]},
            "lm_head_sampling_ms": {"batch": BATCHES, "ms": [lm_head_sampling_ms(b) for b in BATCHES]},
        },
        "kv_transfer": {"bytes_per_s": PCIE_BYTES_PER_S, "fixed_ms": KV_TRANSFER_FIXED_MS},
        "capacities": {"gpu_kv_blocks": int(gpu_kv_bytes // bytes_per_block),
                       "cpu_kv_blocks": int(HOST_KV_BYTES // bytes_per_block),
                       "bytes_per_block": bytes_per_block},
        "notes": "REFERENCE, not measured: assembled from published peak figures and roofline formulas by "
                 "profiles/reference/make_h100_reference.py; sources in h100_sapphire_rapids_llama3_8b.md. "
                 + assumed_engine_note(PCIE_BYTES_PER_S),
    }
    parse_profile(data)  # validate
    return data


def main() -> None:
    path = Path(__file__).with_name("h100_sapphire_rapids_llama3_8b.json")
    save_profile(parse_profile(build()), path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
