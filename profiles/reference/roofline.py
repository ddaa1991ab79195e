"""Roofline tables for the reference profiles: one GPU, one host, one link, Llama-3-8B bf16.

Every latency is max(bytes moved / achieved bandwidth, FLOPs / achieved compute[, host time to
launch the kernels]) + a fixed per-iteration overhead, with the achieved share of each peak an
explicit input. The H100 reference profile was the first user (figures in make_h100_reference.py); the
A10G and L4 profiles (reference_profiles.py) use the same formulas with their own datasheet
figures. Pure arithmetic: nothing is measured here.

`EngineCosts` is what the engine adds on top of the hardware: the per-iteration host overhead,
the host time to launch one layer's kernels (0 when CUDA graphs replay them; with eager ops the
GPU cannot finish a layer before the host has issued it), the KV transfer and the Dense Assist
round trip. A profile's "assumed" variant takes the figures of the engine the design assumes,
its "measured overheads" variant the figures this code measured (reference_profiles.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- model: Llama-3-8B (Meta Llama 3 model card / config.json)
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FFN = 32, 4096, 32, 8, 128, 128256, 14336
DTYPE_BYTES, BLOCK_SIZE = 2, 16
LAYER_PARAMS = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * FFN
DENSE_PARAMS = LAYERS * LAYER_PARAMS  # 6.98e9: QKV + O + gate/up/down of every layer
LM_HEAD_PARAMS = VOCAB * HIDDEN  # 0.525e9 (untied; the embedding lookup reads only B rows)
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 131072 = 128 KiB
RESIDENT_WEIGHT_BYTES = (DENSE_PARAMS + 2 * LM_HEAD_PARAMS) * DTYPE_BYTES  # 16.06 GB incl. the embedding
MODEL = {"architecture": "llama", "num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": HEADS,
         "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "dtype": "bf16",
         "block_size": BLOCK_SIZE}

GPU_PREFILL_TOKENS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
CONTEXTS = [128, 512, 1024, 2048, 4096, 8192, 16384, 32768]


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes_per_s: float  # datasheet peak (HBM or GDDR)
    bf16_flops: float  # datasheet dense tensor peak
    memory_bytes: int
    activation_reserve_bytes: float  # activations, CUDA graphs, allocator slack
    mem_efficiency: float = 0.80  # achieved / peak bandwidth streaming weights and KV
    compute_efficiency: float = 0.50  # achieved / peak for prefill GEMMs + attention (MFU)
    memory_utilization: float = 0.90  # the vLLM default share of device memory the engine may use


@dataclass(frozen=True)
class Host:
    name: str
    cores: int
    memory_bytes: int
    memory_bytes_per_s: float  # theoretical peak of the channels
    dense_flops: float  # peak for the dense GEMMs, at the precision the engine computes them in
    kv_bytes: float  # host memory given to the CPU engine's KV
    mem_efficiency: float = 0.70  # streaming weights
    attn_mem_efficiency: float = 0.60  # paged KV reads
    compute_efficiency: float = 0.25
    iteration_overhead_ms: float = 2.0  # per-layer thread synchronisation + Python per iteration
    attn_layer_overhead_ms: float = 0.02  # per layer: kernel launch over the batch


@dataclass(frozen=True)
class EngineCosts:
    gpu_iteration_overhead_ms: float  # host scheduling + launch per GPU iteration
    gpu_launch_ms_per_layer: float  # host time to issue one layer's kernels (0: CUDA graphs)
    link_bytes_per_s: float  # PCIe, for the Dense Assist payload
    kv_transfer_bytes_per_s: float
    kv_transfer_fixed_ms: float
    assist_round_trip_ms: float  # per layer


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


@dataclass(frozen=True)
class Roofline:
    gpu: Gpu
    host: Host
    engine: EngineCosts

    def _gpu_s(self, num_bytes: float, flops: float) -> float:
        launch_s = LAYERS * self.engine.gpu_launch_ms_per_layer / 1000.0
        return max(num_bytes / (self.gpu.memory_bytes_per_s * self.gpu.mem_efficiency),
                   flops / (self.gpu.bf16_flops * self.gpu.compute_efficiency), launch_s)

    def _host_dense_s(self, params: float, batch: int) -> float:
        return max(params * DTYPE_BYTES / (self.host.memory_bytes_per_s * self.host.mem_efficiency),
                   2 * params * batch / (self.host.dense_flops * self.host.compute_efficiency))

    def gpu_prefill_ms(self, tokens: int) -> float:
        weights = (DENSE_PARAMS + LM_HEAD_PARAMS) * DTYPE_BYTES
        flops = 2 * DENSE_PARAMS * tokens + 2 * LM_HEAD_PARAMS + 2 * LAYERS * tokens * tokens * HEADS * HEAD_DIM
        return round(_ms(self._gpu_s(weights, flops)) + self.engine.gpu_iteration_overhead_ms, 4)

    def gpu_decode_ms(self, batch: int, context: int) -> float:
        num_bytes = (DENSE_PARAMS + LM_HEAD_PARAMS) * DTYPE_BYTES + batch * context * KV_BYTES_PER_TOKEN
        flops = 2 * (DENSE_PARAMS + LM_HEAD_PARAMS) * batch + 4 * LAYERS * batch * context * HEADS * HEAD_DIM
        return round(_ms(self._gpu_s(num_bytes, flops)) + self.engine.gpu_iteration_overhead_ms, 4)

    def cpu_dense_ms(self, batch: int) -> float:
        return round(_ms(self._host_dense_s(DENSE_PARAMS, batch)) + self.host.iteration_overhead_ms, 4)

    def cpu_attention_ms(self, batch: int, context: int) -> float:
        seconds = batch * context * KV_BYTES_PER_TOKEN / (self.host.memory_bytes_per_s * self.host.attn_mem_efficiency)
        return round(_ms(seconds) + LAYERS * self.host.attn_layer_overhead_ms, 4)

    def lm_head_sampling_ms(self, batch: int) -> float:
        sampling = batch * VOCAB * 4 * 3 / (self.host.memory_bytes_per_s * self.host.mem_efficiency)  # fp32 logits
        return _ms(self._host_dense_s(LM_HEAD_PARAMS, batch) + sampling)

    def assist_ms(self, batch: int) -> float:
        weights = (DENSE_PARAMS + LM_HEAD_PARAMS) * DTYPE_BYTES
        device_s = self._gpu_s(weights, 2 * (DENSE_PARAMS + LM_HEAD_PARAMS) * batch)
        per_layer_bytes = batch * ((HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM) * DTYPE_BYTES  # qkv down, attn up
        link_s = LAYERS * per_layer_bytes / self.engine.link_bytes_per_s
        return round(_ms(device_s + link_s) + LAYERS * self.engine.assist_round_trip_ms, 4)

    def kv_blocks(self) -> tuple[int, int]:
        gpu_kv_bytes = (self.gpu.memory_bytes * self.gpu.memory_utilization - RESIDENT_WEIGHT_BYTES
                        - self.gpu.activation_reserve_bytes)
        bytes_per_block = KV_BYTES_PER_TOKEN * BLOCK_SIZE
        return int(gpu_kv_bytes // bytes_per_block), int(self.host.kv_bytes // bytes_per_block)

    def tables(self) -> dict:
        return {
            "gpu_prefill_ms": {"tokens": GPU_PREFILL_TOKENS, "ms": [self.gpu_prefill_ms(t) for t in GPU_PREFILL_TOKENS]},
            "gpu_decode_ms": {"batch": BATCHES, "context_tokens": CONTEXTS,
                              "ms": [[self.gpu_decode_ms(b, c) for c in CONTEXTS] for b in BATCHES]},
            "cpu_dense_ms": {"batch": BATCHES, "ms": [self.cpu_dense_ms(b) for b in BATCHES]},
            "cpu_attention_ms": {"batch": BATCHES, "context_tokens": CONTEXTS,
                                 "ms": [[self.cpu_attention_ms(b, c) for c in CONTEXTS] for b in BATCHES]},
            "assist_ms": {"batch": BATCHES, "ms": [self.assist_ms(b) for b in BATCHES]},
            "lm_head_sampling_ms": {"batch": BATCHES, "ms": [self.lm_head_sampling_ms(b) for b in BATCHES]},
        }

    def profile_dict(self, hardware: dict, notes: str, profiler: dict | None = None) -> dict:
        gpu_blocks, cpu_blocks = self.kv_blocks()
        data = {
            "version": 1,
            "hardware": hardware,
            "model": dict(MODEL),
            "tables": self.tables(),
            "kv_transfer": {"bytes_per_s": self.engine.kv_transfer_bytes_per_s,
                            "fixed_ms": self.engine.kv_transfer_fixed_ms},
            "capacities": {"gpu_kv_blocks": gpu_blocks, "cpu_kv_blocks": cpu_blocks,
                           "bytes_per_block": KV_BYTES_PER_TOKEN * BLOCK_SIZE},
            "notes": notes,
        }
        if profiler is not None:
            data["profiler"] = profiler
        return data
