"""Write a mixture-of-experts Hugging Face folder as a GGUF file in llama.cpp's layout, for tests
(checked once against llama.cpp's own convert_hf_to_gguf.py, whose files of these checkpoints load and
decode the same; it refuses Qwen2-MoE dense layers, which this writer stores as ffn_{gate,up,down}).

What llama.cpp's convert_hf_to_gguf.py writes for these families: Mixtral as architecture "llama"
with an expert count and its Q/K rows permuted; Qwen2-MoE as "qwen2moe" (Q/K as they are). Each
sparse layer's experts are stacked into blk.N.ffn_{gate,up,down}_exps [num_experts, rows, K], its
router is ffn_gate_inp, a shared expert ffn_{gate,up,down}_shexp with its gate ffn_gate_inp_shexp
[1, hidden]. Matrices are written F32 or Q8_0 (routers and norms stay F32, as llama-quantize keeps them).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize
from safetensors.numpy import load_file

from dualpace.model.config import ModelConfig
from dualpace.model.hf_layout import moe_tensor_names

GGUF_ARCHITECTURES = {"mixtral": "llama", "qwen2_moe": "qwen2moe"}


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of the rotary halves of each head's Q/K rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(folder: Path, out_path: Path, q8_0: bool = False) -> Path:
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    moe, arch = config.moe, GGUF_ARCHITECTURES[config.architecture]
    state = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
    if moe.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab] + [t["content"] for t in tokenizer["added_tokens"]
                                              if t["id"] >= len(vocab)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])

    def add(name: str, values: np.ndarray, quantizable: bool = True) -> None:
        values = np.ascontiguousarray(values, dtype=np.float32)
        if q8_0 and quantizable and values.ndim >= 2 and values.shape[-1] % 32 == 0:
            writer.add_tensor(name, quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    names = moe_tensor_names(config.architecture)
    for i in range(config.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        add(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        for part, heads in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", None)):
            for kind in ("weight", "bias"):
                values = state.get(p + f"self_attn.{part}_proj.{kind}")
                if values is not None:
                    add(b + f"attn_{part}.{kind}", _permute(values, heads) if arch == "llama" and heads else values)
        add(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        if not moe.is_sparse_layer(i):
            for part in ("gate", "up", "down"):
                add(b + f"ffn_{part}.weight", state[p + f"mlp.{part}_proj.weight"])
            continue
        add(b + "ffn_gate_inp.weight", state[p + names.router], quantizable=False)
        for part, pattern in (("gate", names.expert_gate), ("up", names.expert_up), ("down", names.expert_down)):
            add(b + f"ffn_{part}_exps.weight",
                np.stack([state[p + pattern.format(e=e)] for e in range(moe.num_experts)]))
        if moe.shared_expert_intermediate_size:
            add(b + "ffn_gate_shexp.weight", state[p + names.shared_gate_proj])
            add(b + "ffn_up_shexp.weight", state[p + names.shared_up_proj])
            add(b + "ffn_down_shexp.weight", state[p + names.shared_down_proj])
            add(b + "ffn_gate_inp_shexp.weight", state[p + names.shared_gate], quantizable=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
