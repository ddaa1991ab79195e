"""Load a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dualpace.errors import ModelLoadError
from dualpace.model.config import ModelConfig
from dualpace.model.transformer import ModelWeights
from dualpace.model.weights import weights_from_hf_names


def read_hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
    return ModelConfig.from_hf_dict(hf)


def _safetensors_files(folder: Path) -> list[Path]:
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index_path} is corrupt: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    return files


def load_hf_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> ModelWeights:
    """Read every shard lazily and assemble the model's weights in `dtype` on the CPU."""
    handles = {}
    name_to_file: dict[str, object] = {}
    try:
        for path in _safetensors_files(folder):
            handle = safe_open(str(path), framework="pt", device="cpu")
            handles[path] = handle
            for name in handle.keys():
                name_to_file[name] = handle
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read weights in {folder}: {exc}") from exc

    def get_tensor(name: str) -> torch.Tensor | None:
        handle = name_to_file.get(name)
        if handle is None:
            return None
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"tensor {name} in {folder} is corrupt: {exc}") from exc

    return weights_from_hf_names(config, get_tensor, dtype)
