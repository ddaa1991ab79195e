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
from dualpace.model.quant import FORMAT_BY_NAME, FORMATS, Q5_0_GGML_TYPE, QuantizedWeight, repack_q5_0_as_q8_0
from dualpace.model.transformer import ModelWeights
from dualpace.model.weights import TensorSource, weights_from_hf_names

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
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        name = names[parts[2]]
        if family.fused_hf_projections and name == "mlp.up_proj.weight":
            name = "mlp.gate_up_proj.weight"
        return f"model.layers.{parts[1]}.{name}"
    return None


def read_gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in FAMILY_BY_GGUF_ARCH:
        raise unsupported(f"architecture {arch!r} in the GGUF")
    family = FAMILY_BY_GGUF_ARCH[arch]
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
    if arch == "llama" and window:  # Mistral, written as llama (as llama.cpp does) with its window kept
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
    return ModelConfig(
        architecture=family.name,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", token_count or -1)),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
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

    by_hf_name = {}
    for tensor in reader.tensors:
        hf_name = gguf_hf_name(tensor.name, config.family)
        if hf_name is not None:
            by_hf_name[hf_name] = tensor
    permute = config.family.gguf_permuted_qk

    def unpermute(name: str, values: np.ndarray) -> np.ndarray:
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            return _unpermute_rows(values, config.num_heads)
        if permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            return _unpermute_rows(values, config.num_kv_heads)
        return values

    def get_tensor(name: str) -> torch.Tensor | QuantizedWeight | None:
        tensor = by_hf_name.get(name)
        if tensor is None:
            return None
        fmt = FORMATS.get(int(tensor.tensor_type))
        if keep_quantized and len(tensor.shape) == 2 and int(tensor.tensor_type) == Q5_0_GGML_TYPE:
            fmt = FORMAT_BY_NAME["Q8_0"]  # held as Q8_0, value for value (repack_q5_0_as_q8_0)
            blocks = repack_q5_0_as_q8_0(np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1))
            return QuantizedWeight.from_blocks(unpermute(name, blocks), fmt, int(tensor.shape[0]))
        if keep_quantized and fmt is not None and len(tensor.shape) == 2:
            k = int(tensor.shape[0])
            blocks = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)
            return QuantizedWeight.from_blocks(unpermute(name, blocks), fmt, k)
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        values = np.asarray(values, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape.tolist())])
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
