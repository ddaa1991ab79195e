"""Load a GGUF file: metadata -> ModelConfig, tensors either kept in their block format
(QuantizedWeight, for the formats of dualpace.model.quant) or dequantized with the `gguf` package.

llama.cpp's converter permutes the rows of Q and K for Llama-architecture models
(its RoPE pairs adjacent dimensions; Hugging Face's pairs the two halves of each
head), so those two weights are permuted back here. Qwen2 GGUFs are not permuted. A quantized row
holds whole blocks of one output row, so the un-permute moves raw block rows unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dualpace.errors import ModelLoadError
from dualpace.model.config import ModelConfig
from dualpace.model.hf_layout import moe_tensor_names
from dualpace.model.moe_spec import MoeSpec
from dualpace.model.quant import FORMAT_BY_NAME, FORMATS, Q5_0_GGML_TYPE, QuantizedWeight, repack_q5_0_as_q8_0
from dualpace.model.transformer import ModelWeights
from dualpace.model.weights import TensorSource, weights_from_hf_names

_PERMUTED_ARCHITECTURES = ("llama", "mistral", "mixtral")
# GGUF general.architecture of a mixture-of-experts model -> ours (llama.cpp writes Mixtral as
# "llama" with an expert count); what llama.cpp's graph for it does with the top-k weights
_MOE_ARCHITECTURES = {"llama": "mixtral", "qwen2moe": "qwen2_moe"}
_MOE_NORMALISED_TOP_K = {"mixtral": True, "qwen2_moe": False}
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


def gguf_hf_name(gguf_name: str, architecture: str) -> str | None:
    """Hugging Face tensor name (of `architecture`'s checkpoints) for a GGUF tensor name (None when
    not used, or for a stacked expert tensor: gguf_expert_tensor)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        return None
    if parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    names = moe_tensor_names(architecture)
    moe_names = {"ffn_gate_inp.weight": names.router, "ffn_gate_shexp.weight": names.shared_gate_proj,
                 "ffn_up_shexp.weight": names.shared_up_proj, "ffn_down_shexp.weight": names.shared_down_proj,
                 "ffn_gate_inp_shexp.weight": names.shared_gate}
    return f"model.layers.{parts[1]}.{moe_names[parts[2]]}" if parts[2] in moe_names else None


def gguf_expert_tensor(gguf_name: str, architecture: str, num_experts: int) -> dict[str, int]:
    """For a stacked expert tensor (blk.N.ffn_{gate,up,down}_exps.weight): the Hugging Face name of
    each expert's matrix -> its index in the stack; {} for any other tensor."""
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _EXPERT_TENSORS:
        return {}
    pattern = getattr(moe_tensor_names(architecture), _EXPERT_TENSORS[parts[2]])
    return {f"model.layers.{parts[1]}." + pattern.format(e=e): e for e in range(num_experts)}


def _gguf_moe(reader, arch: str, num_layers: int, feed_forward: int, tensor_names: set[str]) -> tuple[str, MoeSpec | None]:
    """(our architecture, its MoeSpec) from a GGUF's expert metadata; a layer without a router
    (ffn_gate_inp) keeps a dense MLP."""
    num_experts = int(_field(reader, f"{arch}.expert_count", 0))
    if not num_experts:
        return arch, None
    if arch not in _MOE_ARCHITECTURES:
        raise ModelLoadError(f"unsupported mixture-of-experts GGUF architecture {arch!r}; "
                             f"supported: {', '.join(_MOE_ARCHITECTURES)}")
    architecture = _MOE_ARCHITECTURES[arch]
    shared = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0))
    spec = MoeSpec(
        num_experts=num_experts,
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count")),
        expert_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length", feed_forward)),
        norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", _MOE_NORMALISED_TOP_K[architecture])),
        shared_expert_intermediate_size=shared,
        shared_expert_gated=any(name.endswith("ffn_gate_inp_shexp.weight") for name in tensor_names),
        mlp_only_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
    )
    return architecture, spec


def read_gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("GGUF with rope_freqs (llama3 rope scaling) is not supported; use the HF folder")
    token_count = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id", -1)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", -1)
    num_layers = int(_field(reader, f"{arch}.block_count"))
    feed_forward = int(_field(reader, f"{arch}.feed_forward_length"))
    architecture, moe = _gguf_moe(reader, arch, num_layers, feed_forward, tensor_names)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", token_count or -1)),
        hidden_size=hidden,
        intermediate_size=feed_forward,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=int(bos) if bos >= 0 else None,
        eos_token_ids=(int(eos),) if eos >= 0 else (),
        moe=moe,
    )


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
        hf_name = gguf_hf_name(tensor.name, config.architecture)
        if hf_name is not None:
            by_hf_name[hf_name] = (tensor, None)
        by_hf_name.update({name: (tensor, e) for name, e in gguf_expert_tensor(
            tensor.name, config.architecture, num_experts).items()})
    permute = config.architecture in _PERMUTED_ARCHITECTURES

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
