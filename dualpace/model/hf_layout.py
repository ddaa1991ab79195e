"""The tensor layout of a Hugging Face checkpoint of any supported family (mixture-of-experts MLPs
included): names and shapes."""

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


@dataclass(frozen=True)
class MoeTensorNames:
    """Names, under a layer's prefix, of a mixture-of-experts MLP's tensors in a family's checkpoints."""

    router: str
    expert_gate: str  # with {e}, the expert's index
    expert_up: str
    expert_down: str
    shared_gate_proj: str = "mlp.shared_expert.gate_proj.weight"
    shared_up_proj: str = "mlp.shared_expert.up_proj.weight"
    shared_down_proj: str = "mlp.shared_expert.down_proj.weight"
    shared_gate: str = "mlp.shared_expert_gate.weight"


_QWEN_MOE_NAMES = MoeTensorNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                                 "mlp.experts.{e}.down_proj.weight")
_MIXTRAL_NAMES = MoeTensorNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")


def moe_tensor_names(architecture: str) -> MoeTensorNames:
    return _MIXTRAL_NAMES if architecture == "mixtral" else _QWEN_MOE_NAMES


def moe_layer_specs(config: ModelConfig, prefix: str) -> list[TensorSpec]:
    """The tensors of one sparse layer's MLP (prefix: "model.layers.{i}.")."""
    moe, hidden = config.moe, config.hidden_size
    names = moe_tensor_names(config.architecture)
    ffn = moe.expert_intermediate_size
    specs = [TensorSpec(prefix + names.router, (moe.num_experts, hidden), "linear")]
    for e in range(moe.num_experts):
        specs.append(TensorSpec(prefix + names.expert_gate.format(e=e), (ffn, hidden), "linear"))
        specs.append(TensorSpec(prefix + names.expert_up.format(e=e), (ffn, hidden), "linear"))
        specs.append(TensorSpec(prefix + names.expert_down.format(e=e), (hidden, ffn), "linear"))
    shared = moe.shared_expert_intermediate_size
    if shared:
        specs.append(TensorSpec(prefix + names.shared_gate_proj, (shared, hidden), "linear"))
        specs.append(TensorSpec(prefix + names.shared_up_proj, (shared, hidden), "linear"))
        specs.append(TensorSpec(prefix + names.shared_down_proj, (hidden, shared), "linear"))
        if moe.shared_expert_gated:
            specs.append(TensorSpec(prefix + names.shared_gate, (1, hidden), "linear"))
    return specs


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
        if config.moe is not None and config.moe.is_sparse_layer(layer):
            specs.extend(moe_layer_specs(config, prefix + "."))
            continue
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
