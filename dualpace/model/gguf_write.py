"""Write a Hugging Face folder as a GGUF file, named and laid out as llama.cpp's converter does.

Tensors get llama.cpp's names (the inverse of gguf_loader's table), Q/K rows of the families
llama.cpp permutes are interleaved as its converter does, llama3 RoPE scaling becomes the
rope_freqs tensor, and the tokenizer (byte-level BPE: vocabulary, merges, special tokens, chat
template) goes into `tokenizer.ggml.*`. A mixture-of-experts layer's experts are stacked into
ffn_{gate,up,down}_exps [num_experts, rows, K] (a dense layer of Qwen2-MoE's mlp_only_layers keeps
ffn_{gate,up,down}, which llama.cpp's converter refuses). Matrices are stored as F32, F16 or Q8_0;
norms, biases and the routers (ffn_gate_inp, ffn_gate_inp_shexp) as F32.
`dualpace model export --gguf FORMAT --model FOLDER` runs it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from dualpace.errors import InvalidArgument
from dualpace.model.config import ModelConfig
from dualpace.model.gguf_loader import MOE_NORMALISED_TOP_K, gguf_expert_tensor, gguf_hf_name
from dualpace.model.hf_layout import tensor_specs
from dualpace.model.hf_loader import read_hf_config
from dualpace.model.rope import inverse_frequencies

_GLOBAL_GGUF_NAMES = ("token_embd.weight", "output_norm.weight", "output.weight")
_LAYER_GGUF_NAMES = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias",
                     "attn_k.bias", "attn_v.bias", "attn_qkv.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                     "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
                     "post_attention_norm.weight", "post_ffw_norm.weight")
# a mixture-of-experts layer's: router, experts stacked [num_experts, rows, K], shared expert and its gate
_MOE_GGUF_NAMES = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                   "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")
_ROUTING_GGUF_NAMES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # kept F32, as llama-quantize does
# tokenizer.ggml.pre for the split rules gguf_tokenizer knows, by the rule's pattern
_PRE_BY_PATTERN = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
}


def gguf_names(config: ModelConfig) -> dict[str, str]:
    """Hugging Face tensor name -> GGUF tensor name, for every tensor of `config` (each expert's
    matrix -> the stacked tensor of its layer)."""
    candidates = list(_GLOBAL_GGUF_NAMES) + [f"blk.{i}.{n}" for i in range(config.num_layers)
                                             for n in _LAYER_GGUF_NAMES + _MOE_GGUF_NAMES]
    num_experts = config.moe.num_experts if config.moe is not None else 0
    by_hf = {}
    for name in candidates:
        by_hf[gguf_hf_name(name, config.family)] = name
        by_hf.update(dict.fromkeys(gguf_expert_tensor(name, config.family, num_experts), name))
    return {spec.name: by_hf[spec.name] for spec in tensor_specs(config)}


def _add_moe_metadata(writer, config: ModelConfig) -> None:
    """What llama.cpp's converter writes for the family's experts (Mixtral's width is the model's
    feed_forward_length); expert_weights_norm only where the top-k weights differ from what
    llama.cpp's graph of the family does."""
    moe = config.moe
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.num_experts_per_tok)
    if config.architecture != "mixtral":
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
    if moe.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)
    if moe.norm_topk_prob != MOE_NORMALISED_TOP_K[config.architecture]:
        writer.add_expert_weights_norm(moe.norm_topk_prob)


def _permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order: the two rotary halves of each head interleaved."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(folder: Path):
    from safetensors import safe_open

    handles = [safe_open(str(path), framework="pt", device="cpu") for path in sorted(folder.glob("*.safetensors"))]
    index = {name: handle for handle in handles for name in handle.keys()}
    return lambda name: index[name].get_tensor(name).to(torch.float32).numpy()


def _add_tokenizer(writer, folder: Path, config: ModelConfig) -> None:
    try:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidArgument("--model", f"{folder}: cannot read tokenizer.json / tokenizer_config.json: {exc}") from exc
    model = tokenizer.get("model", {})
    splits = [p for p in (tokenizer.get("pre_tokenizer") or {}).get("pretokenizers", []) if p.get("type") == "Split"]
    pattern = splits[0]["pattern"].get("Regex") if len(splits) == 1 else None
    if model.get("type") != "BPE" or model.get("byte_fallback") or pattern not in _PRE_BY_PATTERN:
        raise InvalidArgument("--model", "--gguf from a Hugging Face folder takes byte-level BPE tokenizers with a "
                              f"Qwen2 or Llama 3 split rule ({', '.join(sorted(set(_PRE_BY_PATTERN.values())))})")
    vocab = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    vocab.update(special)
    tokens = [""] * config.vocab_size
    for text, token_id in vocab.items():
        if token_id < config.vocab_size:
            tokens[token_id] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_PRE_BY_PATTERN[pattern])
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special.values() else 1 for i in range(config.vocab_size)])
    writer.add_token_merges(merges)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        writer.add_eos_token_id(config.eos_token_ids[0])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


def write_gguf_from_hf(folder: Path, out_path: Path, target: str) -> Path:
    """Write the Hugging Face folder `folder` as a GGUF at `out_path`, matrices in `target`
    ("f32", "f16" or "q8_0")."""
    import gguf
    from gguf.quants import quantize

    config = read_hf_config(folder)
    writer = gguf.GGUFWriter(str(out_path), config.family.gguf_name)
    writer.add_name(folder.name)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[target])
    for add, value in ((writer.add_vocab_size, config.vocab_size),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size), (writer.add_block_count, config.num_layers),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_heads), (writer.add_head_count_kv, config.num_kv_heads),
                       (writer.add_key_length, config.head_dim), (writer.add_value_length, config.head_dim),
                       (writer.add_rope_dimension_count, config.num_rotary_dims),
                       (writer.add_rope_freq_base, config.rope_theta),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps)):
        add(value)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    if config.family.gemma:
        writer.add_sliding_window_pattern([config.layer_window(i) is not None for i in range(config.num_layers)])
        writer.add_rope_freq_base_swa(config.local_rope_theta or config.rope_theta)
        writer.add_attention_scale(config.attention_scale)
    if config.moe is not None:
        _add_moe_metadata(writer, config)
    _add_tokenizer(writer, folder, config)
    if config.rope_attention_factor != 1.0 or config.rope_freq_factors is not None:  # LongRoPE, as llama.cpp has it
        long_factor = json.loads((folder / "config.json").read_text())
        long_factor = (long_factor.get("rope_scaling") or long_factor.get("rope_parameters") or {})["long_factor"]
        writer.add_tensor("rope_factors_short.weight", np.asarray(config.rope_freq_factors, dtype=np.float32))
        writer.add_tensor("rope_factors_long.weight", np.asarray(long_factor, dtype=np.float32))
        writer.add_rope_scaling_attn_factors(config.rope_attention_factor)
        writer.add_rope_scaling_orig_ctx_len(config.max_position_embeddings)
    if config.rope_scaling is not None:  # llama.cpp's form: each frequency's divisor
        plain = inverse_frequencies(dataclasses.replace(config, rope_scaling=None))
        writer.add_tensor("rope_freqs.weight", (plain / inverse_frequencies(config)).numpy().astype(np.float32))
    get = _hf_tensors(folder)
    hf_names_of: dict[str, list[str]] = {}  # GGUF name -> its HF tensors (a layer's experts, in order)
    for hf_name, name in gguf_names(config).items():
        hf_names_of.setdefault(name, []).append(hf_name)
    for name, hf_names in hf_names_of.items():
        values = np.stack([get(n) for n in hf_names]) if name.endswith("_exps.weight") else get(hf_names[0])
        if config.family.gguf_permuted_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
            values = _permute_rows(values, config.num_heads)
        elif config.family.gguf_permuted_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
            values = _permute_rows(values, config.num_kv_heads)
        if config.family.gemma and name.endswith("norm.weight"):  # llama.cpp's form: w, not HF's w - 1
            values = values + 1.0
        values = np.ascontiguousarray(values, dtype=np.float32)
        matrix = values.ndim >= 2 and not name.endswith(_ROUTING_GGUF_NAMES)
        if matrix and target == "f16":
            writer.add_tensor(name, values.astype(np.float16))
        elif matrix and target == "q8_0" and values.shape[-1] % 32 == 0:
            writer.add_tensor(name, quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
