"""Write any loadable model (e.g. the default GGUF) as a Hugging Face folder.

The weights are dequantized once and saved as safetensors with Hugging Face names,
so transformers (or any other runtime) can load exactly the weights DualPace runs,
in a dense dtype: benchmarks use it for a like-for-like transformers baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dualpace.errors import InvalidArgument
from dualpace.model.gguf_loader import gguf_tensor_source, open_gguf, read_gguf_config
from dualpace.model.hf_layout import tensor_specs
from dualpace.model.registry import resolve_model_path
from dualpace.model.tokenizer import Tokenizer


def export_hf_folder(model: str, out_dir: Path, dtype: torch.dtype = torch.float32,
                     tokenizer_only: bool = False) -> Path:
    """Export a GGUF model to `out_dir` (config.json, model.safetensors, tokenizer files).
    tokenizer_only: no weights — the folder a tokenizing front (Dynamo's frontend) reads: tokenizer.json,
    tokenizer_config.json with the chat template, config.json."""
    path = resolve_model_path(model)
    if path.is_dir():
        raise InvalidArgument("--model", f"{path} is already a Hugging Face folder")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidArgument("--out", f"{out_dir} exists and is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(path)
    config = read_gguf_config(reader)
    if not tokenizer_only:
        get_tensor = gguf_tensor_source(reader, config)
        tensors = {spec.name: get_tensor(spec.name).to(dtype).contiguous() for spec in tensor_specs(config)}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer = Tokenizer.from_gguf(reader)
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos_token,
        "bos_token": tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": tokenizer.id_to_token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
        "model_max_length": config.max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out_dir
