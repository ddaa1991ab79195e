"""A tiny hand-made profile whose predictions are easy to compute by hand."""

from __future__ import annotations

import copy

# KV bytes per token: 2 (K,V) * 2 layers * 1 kv head * 4 dim * 2 bytes (bf16) = 32; block of 4 tokens = 128.
TINY = {
    "version": 1,
    "hardware": {"cpu_model": "Test CPU", "cpu_cores": 4, "memory_bytes": 8 * 2**30,
                 "memory_bandwidth_bytes_per_s": 1e10, "gpu_model": "Test GPU", "gpu_memory_bytes": 2**30},
    "model": {"architecture": "llama", "num_layers": 2, "hidden_size": 8, "num_heads": 2, "num_kv_heads": 1,
              "head_dim": 4, "vocab_size": 100, "dtype": "bf16", "block_size": 4},
    "tables": {
        "gpu_prefill_ms": {"tokens": [1, 101], "ms": [10.0, 20.0]},
        "gpu_decode_ms": {"batch": [1, 11], "context_tokens": [0, 100], "ms": [[10.0, 20.0], [20.0, 40.0]]},
        "cpu_dense_ms": {"batch": [1, 11], "ms": [30.0, 40.0]},
        "cpu_attention_ms": {"batch": [1, 11], "context_tokens": [0, 100], "ms": [[0.0, 10.0], [0.0, 20.0]]},
        "assist_ms": {"batch": [1, 11], "ms": [25.0, 25.0]},
        "lm_head_sampling_ms": {"batch": [1, 11], "ms": [5.0, 5.0]},
    },
    "kv_transfer": {"bytes_per_s": 32000.0, "fixed_ms": 2.0},
    "capacities": {"gpu_kv_blocks": 64, "cpu_kv_blocks": 256, "bytes_per_block": 128},
}


def tiny_profile_dict() -> dict:
    return copy.deepcopy(TINY)
