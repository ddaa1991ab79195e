"""The tensor layout of a Hugging Face checkpoint of any supported family: names and shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dualpace.model.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: Hugging Face name, shape, and init kind ("linear", "embedding" or "norm")."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every checkpoint tensor of `config`, in Hugging Face names and drawing order."""
    hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", (config.vocab_size, hidden), "embedding")]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        specs.append(TensorSpec(f"{prefix}.input_layernorm.weight", (hidden,), "norm"))
        if config.family.fused_hf_projections:
            specs.append(TensorSpec(f"{prefix}.self_attn.qkv_proj.weight", (q_dim + 2 * kv_dim, hidden), "linear"))
        else:
            for proj, out_dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                specs.append(TensorSpec(f"{prefix}.self_attn.{proj}.weight", (out_dim, hidden), "linear"))
                if config.qkv_bias:
                    specs.append(TensorSpec(f"{prefix}.self_attn.{proj}.bias", (out_dim,), "linear"))
        if config.qk_norm:
            for name in ("q_norm", "k_norm"):
                specs.append(TensorSpec(f"{prefix}.self_attn.{name}.weight", (config.head_dim,), "norm"))
        specs.append(TensorSpec(f"{prefix}.self_attn.o_proj.weight", (hidden, q_dim), "linear"))
        specs.append(TensorSpec(f"{prefix}.post_attention_layernorm.weight", (hidden,), "norm"))
        if config.family.gemma:
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                specs.append(TensorSpec(f"{prefix}.{name}.weight", (hidden,), "norm"))
        if config.family.fused_hf_projections:
            specs.append(TensorSpec(f"{prefix}.mlp.gate_up_proj.weight", (2 * config.intermediate_size, hidden),
                                    "linear"))
        else:
            for proj in ("gate_proj", "up_proj"):
                specs.append(TensorSpec(f"{prefix}.mlp.{proj}.weight", (config.intermediate_size, hidden), "linear"))
        specs.append(TensorSpec(f"{prefix}.mlp.down_proj.weight", (hidden, config.intermediate_size), "linear"))
    specs.append(TensorSpec("model.norm.weight", (hidden,), "norm"))
    if not config.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (config.vocab_size, hidden), "embedding"))
    return specs


def count_parameters(config: ModelConfig) -> int:
    """Number of parameters of `config` (tied embeddings counted once), without allocating."""
    return sum(spec.num_elements for spec in tensor_specs(config))
