"""Write a Hugging Face folder (Llama, Mistral or Qwen2; e.g. `dualpace model synth`) as a GGUF file
(`dualpace model export --model FOLDER --gguf f16|bf16|q8_0|f32 --out FILE`), loadable by DualPace and
by llama.cpp, so that a real-size checkpoint becomes a GGUF without an outside converter (K-quants
then come from llama.cpp's `llama-quantize` on the f16/bf16 file).

What it writes, as llama.cpp's converter does for these architectures: the `{arch}.*` shape keys,
the byte-level BPE tokenizer of tokenizer.json (tokens by id, merges, added special tokens as
control tokens, pre-tokenizer "gpt2"), the tensors under GGUF names with the rows of Q and K
interleaved per head for Llama / Mistral (llama.cpp's RoPE pairs adjacent dimensions; the loader
undoes it, dualpace.model.gguf_loader), matrices in the target format (q8_0: quantized with the
`gguf` package, K a multiple of 32) and norms and biases in F32. Models with rope scaling are
refused (their GGUF needs a rope_freqs tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dualpace.errors import InvalidArgument
from dualpace.model.config import ModelConfig
from dualpace.model.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES, _PERMUTED_ARCHITECTURES
from dualpace.model.hf_loader import read_hf_config, safetensors_tensor_source

TARGETS = ("f32", "f16", "bf16", "q8_0")


def _permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's per-head interleaving of the rotary halves (the inverse of the loader's un-permute)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(GGUF name, Hugging Face name) of every tensor the model has."""
    names = [(g, h) for g, h in _GLOBAL_NAMES.items() if g != "output.weight" or not config.tie_word_embeddings]
    for i in range(config.num_layers):
        for g, h in _LAYER_NAMES.items():
            if g.endswith(".bias") and not config.qkv_bias:
                continue
            names.append((f"blk.{i}.{g}", f"model.layers.{i}.{h}"))
    return names


def _add_tokenizer(writer, folder: Path, config: ModelConfig) -> None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise InvalidArgument("--model", f"{folder} has no tokenizer.json")
    spec = json.loads(path.read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise InvalidArgument("--model", f"{path}: only byte-level BPE tokenizers are exported, not {model.get('type')}")
    vocab = dict(model["vocab"])
    special = set()
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    size = max(config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # unused
    for text, token_id in vocab.items():
        tokens[token_id] = text
        types[token_id] = 3 if token_id in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_ids:
        writer.add_eos_token_id(config.eos_token_ids[0])


def export_gguf(model: Path, out_path: Path, target: str = "q8_0") -> Path:
    """Write the Hugging Face folder `model` as a GGUF file at `out_path` (matrices in `target`)."""
    import gguf
    from gguf.quants import quantize

    if target not in TARGETS:
        raise InvalidArgument("--gguf", f"unknown target {target!r}; use {', '.join(TARGETS)}")
    folder, out_path = Path(model), Path(out_path)
    if out_path.exists():
        raise InvalidArgument("--out", f"{out_path} exists")
    config = read_hf_config(folder)
    if config.rope_scaling is not None:
        raise InvalidArgument("--model", "rope scaling (llama3) is not exported: its GGUF needs a rope_freqs tensor")
    get_tensor = safetensors_tensor_source(folder)
    qtype, file_type = {
        "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
        "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
        "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
        "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    }[target]
    arch = config.architecture
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_name(folder.name)
    writer.add_file_type(file_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    if config.head_dim != config.hidden_size // config.num_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, folder, config)
    permute = arch in _PERMUTED_ARCHITECTURES
    for gguf_name, hf_name in _gguf_names(config):
        tensor = get_tensor(hf_name)
        if tensor is None:
            raise InvalidArgument("--model", f"{folder} lacks the tensor {hf_name}")
        values = tensor.to(torch.float32).numpy()
        if permute and hf_name.endswith("q_proj.weight"):
            values = _permute_rows(values, config.num_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            values = _permute_rows(values, config.num_kv_heads)
        if values.ndim != 2 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(values, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, values.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.Q8_0 and values.shape[1] % 32:
            writer.add_tensor(gguf_name, values.astype(np.float16))  # no whole blocks: dense, as llama.cpp does
        else:
            writer.add_tensor(gguf_name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
