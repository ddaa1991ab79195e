"""Load a model by name, Hugging Face folder or .gguf file: config, weights and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dualpace.errors import InvalidArgument
from dualpace.model.config import ModelConfig
from dualpace.model.registry import resolve_model_path
from dualpace.model.tokenizer import Tokenizer
from dualpace.model.transformer import Transformer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer

    @property
    def max_context_tokens(self) -> int:
        return self.config.max_position_embeddings


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`auto` is bf16: decode is memory-bound and bf16 halves the bytes read per step."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise InvalidArgument("dtype", f"unknown dtype {dtype!r}; use auto, fp32 or bf16")
    return DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument("device", "CUDA was requested but is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise InvalidArgument("device", f"unknown device {device!r}; use auto, cuda or cpu")
    return torch.device(device)


def load_model(model: str, dtype: str | torch.dtype = "auto", device: str = "cpu") -> LoadedModel:
    """Load config, weights (in `dtype`, on `device`) and tokenizer."""
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    path = resolve_model_path(model)
    if path.is_dir():
        from dualpace.model.hf_loader import load_hf_weights, read_hf_config

        config = read_hf_config(path)
        tokenizer = Tokenizer.from_hf_folder(path)
        weights = load_hf_weights(path, config, torch_dtype)
    else:
        from dualpace.model.gguf_loader import load_gguf_weights, open_gguf, read_gguf_config

        reader = open_gguf(path)
        config = read_gguf_config(reader)
        tokenizer = Tokenizer.from_gguf(reader)
        weights = load_gguf_weights(reader, config, torch_dtype)
    weights = weights.to(torch_device, torch_dtype)
    return LoadedModel(name=model, path=path, config=config, model=Transformer(config, weights), tokenizer=tokenizer)


def load_tokenizer_and_config(model: str) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and shape of a model without its weights (for the router)."""
    path = resolve_model_path(model)
    if path.is_dir():
        from dualpace.model.hf_loader import read_hf_config

        return Tokenizer.from_hf_folder(path), read_hf_config(path)
    from dualpace.model.gguf_loader import open_gguf, read_gguf_config

    reader = open_gguf(path)
    return Tokenizer.from_gguf(reader), read_gguf_config(reader)
