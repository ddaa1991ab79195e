"""Assemble ModelWeights from Hugging Face-named tensors, with shape checks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dualpace.errors import ModelLoadError
from dualpace.model.config import ModelConfig
from dualpace.model.hf_layout import moe_tensor_names
from dualpace.model.moe import MoeWeights
from dualpace.model.quant import cat_rows
from dualpace.model.transformer import LayerWeights, ModelWeights

# get_tensor(name) returns a float tensor (or a QuantizedWeight for a matrix kept in its block
# format), or None when the checkpoint lacks it.
TensorSource = Callable[[str], "torch.Tensor | None"]


def _require(get_tensor: TensorSource, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    tensor = get_tensor(name)
    if tensor is None:
        raise ModelLoadError(f"checkpoint is missing tensor {name}")
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _moe_weights(config: ModelConfig, prefix: str, get: Callable[[str, tuple[int, ...]], torch.Tensor]) -> MoeWeights:
    """One sparse layer's router and experts (each expert's gate and up fused into one matrix)."""
    spec, hidden = config.moe, config.hidden_size
    names = moe_tensor_names(config.architecture)
    ffn = spec.expert_intermediate_size
    gate_up = [cat_rows([get(prefix + names.expert_gate.format(e=e), (ffn, hidden)),
                         get(prefix + names.expert_up.format(e=e), (ffn, hidden))]) for e in range(spec.num_experts)]
    down = [get(prefix + names.expert_down.format(e=e), (hidden, ffn)) for e in range(spec.num_experts)]
    weights = MoeWeights(get(prefix + names.router, (spec.num_experts, hidden)), gate_up, down)
    shared = spec.shared_expert_intermediate_size
    if shared:
        weights.shared_gate_up = cat_rows([get(prefix + names.shared_gate_proj, (shared, hidden)),
                                           get(prefix + names.shared_up_proj, (shared, hidden))])
        weights.shared_down = get(prefix + names.shared_down_proj, (hidden, shared))
        if spec.shared_expert_gated:
            weights.shared_gate = get(prefix + names.shared_gate, (1, hidden))
    return weights


def weights_from_hf_names(config: ModelConfig, get_tensor: TensorSource, dtype: torch.dtype) -> ModelWeights:
    """Build fused per-layer weights from tensors named as in Hugging Face checkpoints."""
    hidden, ffn, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return _require(get_tensor, name, shape).to(dtype)

    def get_norm(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Gemma's checkpoints hold RMSNorm weights as w - 1: stored here as w, in float32 first."""
        if not config.family.gemma:
            return get(name, shape)
        return (_require(get_tensor, name, shape).to(torch.float32) + 1.0).to(dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv_shapes = ((q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden))
        moe = gate_up = down = None
        if config.moe is not None and config.moe.is_sparse_layer(i):
            moe = _moe_weights(config, p, get)
        else:
            down = get(p + "mlp.down_proj.weight", (hidden, ffn))
        if config.family.fused_hf_projections:  # Phi-3: already one qkv and one [gate | up] matrix
            qkv = get(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, hidden))
            gate_up = get(p + "mlp.gate_up_proj.weight", (2 * ffn, hidden))
        else:
            qkv = cat_rows([get(p + f"self_attn.{name}_proj.weight", shape) for name, shape in zip("qkv", qkv_shapes)])
            if moe is None:
                gate_up = cat_rows(
                    [get(p + "mlp.gate_proj.weight", (ffn, hidden)), get(p + "mlp.up_proj.weight", (ffn, hidden))]
                )
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([get(p + f"self_attn.{name}_proj.bias", shape[:1])
                                  for name, shape in zip("qkv", qkv_shapes)])
        q_norm = k_norm = None
        if config.qk_norm:
            q_norm = get_norm(p + "self_attn.q_norm.weight", (head_dim,))
            k_norm = get_norm(p + "self_attn.k_norm.weight", (head_dim,))
        sandwich = {}
        if config.family.gemma:  # HF's post_attention_layernorm is over the attention output here
            sandwich = dict(attention_out_norm=get_norm(p + "post_attention_layernorm.weight", (hidden,)),
                            mlp_out_norm=get_norm(p + "post_feedforward_layernorm.weight", (hidden,)))
        pre_mlp_norm = "pre_feedforward_layernorm" if config.family.gemma else "post_attention_layernorm"
        layers.append(
            LayerWeights(
                input_norm=get_norm(p + "input_layernorm.weight", (hidden,)),
                qkv_proj=qkv,
                qkv_bias=qkv_bias,
                o_proj=get(p + "self_attn.o_proj.weight", (hidden, q_rows)),
                post_attention_norm=get_norm(p + f"{pre_mlp_norm}.weight", (hidden,)),
                gate_up_proj=gate_up,
                down_proj=down,
                q_norm=q_norm,
                k_norm=k_norm,
                **sandwich,
                moe=moe,
            )
        )
    embed = get("model.embed_tokens.weight", (config.vocab_size, hidden))
    if config.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (config.vocab_size, hidden))
    return ModelWeights(
        embed_tokens=embed, layers=layers, final_norm=get_norm("model.norm.weight", (hidden,)), lm_head=lm_head
    )
