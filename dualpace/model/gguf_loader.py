"""Load a GGUF file: metadata -> ModelConfig, tensors either kept in their block format
(QuantizedWeight, for the formats of dualpace.model.quant) or dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of Q and K for Llama-architecture models
(its RoPE pairs adjacent dimensions; Hugging Face's pairs the two halves of each
head), so those two weights are permuted back here (Family.gguf_permuted_qk; Qwen and Phi-3 GGUFs
are not permuted). A quantized row holds whole blocks of one output row, so the un-permute moves
raw block rows unchanged. Llama 3's RoPE scaling is the rope_freqs tensor (a divisor per rotation
frequency), read into ModelConfig.rope_freq_factors, as are LongRoPE's rope_factors_short (the
context then stops at the original one, where those factors hold).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dualpace.errors import ModelLoadError
from dualpace.model.config import FAMILIES, FAMILY_BY_GGUF_ARCH, Family, ModelConfig, unsupported
from dualpace.model.hf_layout import moe_tensor_names
from dualpace.model.moe_spec import MOE_HF_MODEL_TYPES, MoeSpec
from dualpace.model.quant import FORMAT_BY_NAME, FORMATS, Q5_0_GGML_TYPE, QuantizedWeight, repack_q5_0_as_q8_0
from dualpace.model.transformer import ModelWeights
from dualpace.model.weights import TensorSource, weights_from_hf_names

# what llama.cpp's graph of each mixture-of-experts family does with the top-k weights
MOE_NORMALISED_TOP_K = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
# llama.cpp's stacked expert tensors [num_experts, rows, K] -> the MoeTensorNames field of one expert
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "expert_gate", "ffn_up_exps.weight": "expert_up",
                   "ffn_down_exps.weight": "expert_down"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata is missing {key}")
        return default
    return field.contents()


# Gemma's sandwich norms: ffn_norm is the norm before the MLP, the others follow attention and MLP
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def gguf_hf_name(gguf_name: str, family: Family) -> str | None:
    """Hugging Face tensor name for a GGUF tensor name of `family` (None when not used). For
    fused_hf_projections (Phi-3), ffn_up is the fused [gate | up] matrix."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if family.gemma else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        return None
    if parts[2] in names:
        name = names[parts[2]]
        if family.fused_hf_projections and name == "mlp.up_proj.weight":
            name = "mlp.gate_up_proj.weight"
        return f"model.layers.{parts[1]}.{name}"
    moe = moe_tensor_names(family.name)
    moe_names = {"ffn_gate_inp.weight": moe.router, "ffn_gate_shexp.weight": moe.shared_gate_proj,
                 "ffn_up_shexp.weight": moe.shared_up_proj, "ffn_down_shexp.weight": moe.shared_down_proj,
                 "ffn_gate_inp_shexp.weight": moe.shared_gate}
    return f"model.layers.{parts[1]}.{moe_names[parts[2]]}" if parts[2] in moe_names else None


def gguf_expert_tensor(gguf_name: str, family: Family, num_experts: int) -> dict[str, int]:
    """For a stacked expert tensor (blk.N.ffn_{gate,up,down}_exps.weight): the Hugging Face name of
    each expert's matrix -> its index in the stack; {} for any other tensor."""
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _EXPERT_TENSORS:
        return {}
    pattern = getattr(moe_tensor_names(family.name), _EXPERT_TENSORS[parts[2]])
    return {f"model.layers.{parts[1]}." + pattern.format(e=e): e for e in range(num_experts)}


def _gguf_family(reader, arch: str) -> Family:
    """The family of a GGUF: its architecture's, Mixtral for a "llama" file with experts."""
    if arch not in FAMILY_BY_GGUF_ARCH:
        raise unsupported(f"architecture {arch!r} in the GGUF")
    family = FAMILY_BY_GGUF_ARCH[arch]
    num_experts = int(_field(reader, f"{arch}.expert_count", 0))
    if num_experts and family.name == "llama":
        return FAMILIES["mixtral"]
    if bool(num_experts) != (family.name in MOE_HF_MODEL_TYPES):
        raise unsupported(f"feature of {arch}: {'an' if num_experts else 'no'} expert count in the GGUF")
    return family


def _gguf_moe(reader, arch: str, family: Family, num_layers: int, feed_forward: int,
              tensor_names) -> MoeSpec | None:
    """The MoeSpec of a mixture-of-experts GGUF; a layer without a router (ffn_gate_inp) keeps a dense MLP."""
    if family.name not in MOE_HF_MODEL_TYPES:
        return None
    shared = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0))
    return MoeSpec(
        num_experts=int(_field(reader, f"{arch}.expert_count")),
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count")),
        expert_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length", feed_forward)),
        norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", MOE_NORMALISED_TOP_K[family.name])),
        shared_expert_intermediate_size=shared,
        shared_expert_gated=any(name.endswith("ffn_gate_inp_shexp.weight") for name in tensor_names),
        mlp_only_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
    )


def read_gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    family = _gguf_family(reader, arch)
    tensors = {t.name: t for t in reader.tensors}
    token_count = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    rotary_dim = int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads))
    # llama.cpp writes key_length where a head is not hidden / heads; without it, Llama-family files
    # rotate whole heads (rope.dimension_count is head_dim), Phi-3's may rotate part of each
    default_head_dim = hidden // num_heads if arch == "phi3" else rotary_dim
    head_dim = int(_field(reader, f"{arch}.attention.key_length", default_head_dim))
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0))  # where a file has one, any family
    if family.name == "llama" and window:  # Mistral, written as llama (as llama.cpp does) with its window kept
        family = FAMILIES["mistral"]
    max_positions = int(_field(reader, f"{arch}.context_length"))
    rope_freqs = tensors.get("rope_freqs.weight")
    longrope = {}
    if "rope_factors_short.weight" in tensors:  # LongRoPE (Phi-3): short factors, up to the original context
        rope_freqs = tensors["rope_factors_short.weight"]
        max_positions = min(max_positions, int(_field(reader, f"{arch}.rope.scaling.original_context_length",
                                                      max_positions)))
        longrope = dict(rope_attention_factor=float(_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)))
    eos = _field(reader, "tokenizer.ggml.eos_token_id", -1)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", -1)
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", ""):
        raise unsupported(f"feature of {arch}: rope scaling {_field(reader, f'{arch}.rope.scaling.type')!r} in the GGUF")
    num_layers = int(_field(reader, f"{arch}.block_count"))
    feed_forward = int(_field(reader, f"{arch}.feed_forward_length"))
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", token_count or -1)),
        hidden_size=hidden,
        intermediate_size=feed_forward,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=None if rope_freqs is None else tuple(
            float(f) for f in np.asarray(rope_freqs.data, dtype=np.float32).reshape(-1)),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=family.qk_norm,
        sliding_window=window if 0 < window < max_positions else None,
        **(_gemma_fields(reader, arch, num_layers, hidden, num_heads, head_dim) if family.gemma else {}),
        **longrope,
        bos_token_id=int(bos) if bos >= 0 else None,
        eos_token_ids=(int(eos),) if eos >= 0 else (),
        moe=_gguf_moe(reader, arch, family, num_layers, feed_forward, tensors),
    )


def _gemma_fields(reader, arch: str, num_layers: int, hidden: int, num_heads: int, head_dim: int) -> dict:
    """Gemma 3's per-layer windows, local theta and query scale, with llama.cpp's defaults where a
    file does not say: every 6th layer global, local theta 10000, scale 1/sqrt(head_dim) (27B,
    62 layers: 1/sqrt(hidden / heads)); attention.scale where written is the scale itself."""
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):
        windowed = tuple(bool(w) for w in pattern)
    else:
        windowed = tuple(bool((i + 1) % int(pattern)) for i in range(num_layers))
    return dict(window_layers=None if all(windowed) else windowed,
                local_rope_theta=float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
                # the scale is stored in float32; the scalar it came from is an integer (transformers' type)
                query_pre_attn_scalar=(float(round(float(_field(reader, f"{arch}.attention.scale", 0.0)) ** -2))
                                       if f"{arch}.attention.scale" in reader.fields
                                       else float(hidden // num_heads if num_layers == 62 else head_dim)))


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of the rotary halves in Q/K rows."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensor_source(reader, config: ModelConfig, keep_quantized: bool = False) -> TensorSource:
    """A function from Hugging Face tensor name to the tensor (or None): dequantized to float32,
    or with `keep_quantized` a QuantizedWeight for 2-D tensors in a supported block format."""
    from gguf.quants import dequantize

    by_hf_name = {}  # HF name -> (GGUF tensor, expert index in a stacked tensor or None)
    num_experts = config.moe.num_experts if config.moe is not None else 0
    for tensor in reader.tensors:
        hf_name = gguf_hf_name(tensor.name, config.family)
        if hf_name is not None:
            by_hf_name[hf_name] = (tensor, None)
        by_hf_name.update({name: (tensor, e) for name, e in gguf_expert_tensor(
            tensor.name, config.family, num_experts).items()})
    permute = config.family.gguf_permuted_qk

    def unpermute(name: str, values: np.ndarray) -> np.ndarray:
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            return _unpermute_rows(values, config.num_heads)
        if permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            return _unpermute_rows(values, config.num_kv_heads)
        return values

    def get_tensor(name: str) -> torch.Tensor | QuantizedWeight | None:
        tensor, expert = by_hf_name.get(name, (None, None))
        if tensor is None:
            return None
        fmt = FORMATS.get(int(tensor.tensor_type))
        # a matrix: the tensor, or one expert's slice of a stacked [num_experts, rows, K] tensor
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        data = tensor.data
        if expert is not None:
            shape = shape[1:]
            data = np.asarray(data).reshape(num_experts, shape[0], -1)[expert]
        is_matrix = len(shape) == 2
        if keep_quantized and is_matrix and int(tensor.tensor_type) == Q5_0_GGML_TYPE:
            fmt = FORMAT_BY_NAME["Q8_0"]  # held as Q8_0, value for value (repack_q5_0_as_q8_0)
            blocks = repack_q5_0_as_q8_0(np.asarray(data).reshape(shape[0], -1))
            return QuantizedWeight.from_blocks(unpermute(name, blocks), fmt, shape[1])
        if keep_quantized and fmt is not None and is_matrix:
            blocks = np.asarray(data).reshape(shape[0], -1)
            return QuantizedWeight.from_blocks(unpermute(name, blocks), fmt, shape[1])
        try:
            values = dequantize(data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        values = unpermute(name, values)
        if config.family.gemma and name.endswith("norm.weight"):  # llama.cpp stores Gemma's w; HF w - 1
            values = values - 1.0
        if not values.flags.writeable:  # F32 tensors are views of the memory-mapped file
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values))

    return get_tensor


def load_gguf_weights(reader, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = False) -> ModelWeights:
    return weights_from_hf_names(config, gguf_tensor_source(reader, config, keep_quantized), dtype)


def gguf_tensor_types(reader) -> dict[str, int]:
    """GGML type name -> number of tensors of that type in the file."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts
