"""Hugging Face transformers on a model's weights, as the reference the CPU decode benchmark runs
beside our engine (bench/cpu_decode.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from dualpace.model.loader import LoadedModel


def load_hf_model(loaded: LoadedModel):
    """transformers on the same weights in dense bf16. A GGUF is exported to a Hugging Face
    folder first: loaded from the GGUF directly, transformers may keep the quantized blocks and
    compute through dequantizing kernels, which is not the dense bf16 baseline."""
    from transformers import AutoModelForCausalLM

    from dualpace.model.export import export_hf_folder

    path = loaded.path
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as folder:
        export_hf_folder(str(path), Path(folder), torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
