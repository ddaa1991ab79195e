"""Load a model by name, Hugging Face folder or .gguf file: config, weights and tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dualpace.errors import InvalidArgument
from dualpace.model.config import ModelConfig
from dualpace.model.moe_spec import MoeWeightBytes
from dualpace.model.registry import resolve_model_path
from dualpace.model.tokenizer import Tokenizer
from dualpace.model.transformer import ModelWeights, Transformer

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# How weights are held: `native` keeps a GGUF's block-quantized matrices as they are in the file
# (an HF checkpoint as stored), `bf16`/`fp32` dequantize everything at load, `int8` quantizes the
# matrices at load to Q8_0 (int8 per group of 32 along the input dimension, fp16 scale).
WEIGHT_MODES = ("native", "bf16", "fp32", "int8")


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    # How the weights are held: the --weights mode and every matrix storage format in use,
    # e.g. "native:q4_1,float32" (what the prefix cache's salt names, dualpace.engine.core).
    weights_format: str = "native"

    @property
    def max_context_tokens(self) -> int:
        return self.config.max_position_embeddings


def resolve_dtype(dtype: str | torch.dtype, device_type: str = "cpu") -> torch.dtype:
    """The compute dtype. `auto`: what is fastest on that device (dualpace.model.dtype_auto: bf16 on
    a GPU or a CPU with native bf16, else fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        from dualpace.model.dtype_auto import auto_dtypes

        return auto_dtypes(device_type).compute
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


def _compute_dtype(dtype: str | torch.dtype, weights: str) -> str | torch.dtype:
    """`--weights fp32` holds fp32 matrices, which want fp32 compute; `--weights bf16` runs with
    either compute dtype (fp32 compute widens bf16 matrices, in the CPU kernels' registers)."""
    if weights not in WEIGHT_MODES:
        raise InvalidArgument("weights", f"unknown weights mode {weights!r}; use {', '.join(WEIGHT_MODES)}")
    if weights == "fp32":
        if dtype == "auto":
            return weights
        if resolve_dtype(dtype) != DTYPES[weights]:
            raise InvalidArgument("weights", f"--weights {weights} holds {weights} matrices; the compute dtype "
                                  f"{dtype} must match (or leave --dtype auto)")
    return dtype


def _matrix_dtype(dtype: str | torch.dtype, weights: str, device: torch.device, compute: torch.dtype) -> torch.dtype:
    """The dtype dense matrices are held in."""
    if weights in ("bf16", "fp32"):
        return DTYPES[weights]
    if dtype == "auto":
        from dualpace.model.dtype_auto import auto_dtypes

        return auto_dtypes(device.type).matrices
    return compute


def load_model(model: str, dtype: str | torch.dtype = "auto", device: str = "cpu",
               weights: str = "native") -> LoadedModel:
    """Load config, weights (see WEIGHT_MODES; compute dtype `dtype`, on `device`) and tokenizer.
    On a GPU, block-quantized weights are dequantized at load to the compute dtype."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(_compute_dtype(dtype, weights), torch_device.type)
    matrix_dtype = _matrix_dtype(dtype, weights, torch_device, torch_dtype)
    path = resolve_model_path(model)
    if path.is_dir():
        from dualpace.model.hf_loader import load_hf_weights, read_hf_config

        config = read_hf_config(path)
        tokenizer = Tokenizer.from_hf_folder(path)
        model_weights = load_hf_weights(path, config, torch_dtype)
    else:
        from dualpace.model.gguf_loader import load_gguf_weights, open_gguf, read_gguf_config

        reader = open_gguf(path)
        config = read_gguf_config(reader)
        tokenizer = Tokenizer.from_gguf(reader)
        keep = weights == "native" and torch_device.type == "cpu" and _quant_kernels_available()
        model_weights = load_gguf_weights(reader, config, torch_dtype, keep_quantized=keep)
    if weights == "int8":
        model_weights = quantize_weights_q8_0(model_weights)
    model_weights = model_weights.to(torch_device, torch_dtype, matrix_dtype)
    log.info("weights: %s", describe_weights(model_weights, torch_device, torch_dtype, config))
    return LoadedModel(name=model, path=path, config=config, model=Transformer(config, model_weights),
                       tokenizer=tokenizer, weights_format=f"{weights}:{','.join(weight_formats(model_weights))}")


def _quant_kernels_available() -> bool:
    from dualpace.model import quant_kernels

    if quant_kernels.get() is None:
        log.warning("quantized-weight kernels are off here: dequantizing the GGUF's weights at load")
        return False
    return True


def _matrices(weights: ModelWeights) -> list:
    mats = [weights.embed_tokens] + ([] if weights.lm_head is weights.embed_tokens else [weights.lm_head])
    for layer in weights.layers:
        mats.extend(m for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) if m is not None)
        if layer.moe is not None:
            mats.extend(layer.moe.matrices())
    return mats


def _num_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.num_bytes()


def weights_num_bytes(weights: ModelWeights) -> int:
    """Host (or device) bytes held by all weights, block-quantized or dense."""
    return weights.num_bytes()


def moe_weight_bytes(weights: ModelWeights, config: ModelConfig) -> MoeWeightBytes | None:
    """What a decode step of a mixture-of-experts model reads, in the formats held (None for a
    dense model): the routed experts apart (one expert of one layer, on average) from the rest,
    which every step reads (the embedding table apart, of which a step reads a row per token)."""
    if config.moe is None:
        return None
    sparse = [layer.moe for layer in weights.layers if layer.moe is not None]
    routed_bytes = sum(_num_bytes(m) for moe in sparse for m in (*moe.expert_gate_up, *moe.expert_down))
    embedding_bytes = 0 if weights.lm_head is weights.embed_tokens else _num_bytes(weights.embed_tokens)
    return MoeWeightBytes(
        num_experts=config.moe.num_experts, num_experts_per_tok=config.moe.num_experts_per_tok,
        dense_bytes=weights_num_bytes(weights) - routed_bytes - embedding_bytes,
        expert_bytes=round(routed_bytes / (len(sparse) * config.moe.num_experts)), num_sparse_layers=len(sparse))


def weight_formats(weights: ModelWeights) -> list[str]:
    """The storage formats of the matrices, sorted (e.g. ["float32", "q4_1"])."""
    from dualpace.model.quant import QuantizedWeight

    names: set[str] = set()
    for t in _matrices(weights):
        names.update(t.formats if isinstance(t, QuantizedWeight) else [str(t.dtype).removeprefix("torch.")])
    return sorted(names)


def describe_weights(weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                     config: ModelConfig | None = None) -> str:
    """One line for the start-up log: bytes held, storage formats, compute dtype; for a
    mixture-of-experts model, the bytes a token reads per step (its k routed experts per layer)."""
    from dualpace.model.quant import QuantizedWeight

    counts: dict[str, int] = {}
    for t in _matrices(weights):
        names = t.formats if isinstance(t, QuantizedWeight) else [str(t.dtype).removeprefix("torch.")]
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    formats = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
    line = (f"{weights_num_bytes(weights) / 1e6:.1f} MB in {device.type} memory (matrices: {formats}; "
            f"compute {str(dtype).removeprefix('torch.')})")
    moe = None if config is None else moe_weight_bytes(weights, config)
    return line if moe is None else f"{line}; {moe.summary()}"


def quantize_weights_q8_0(weights: ModelWeights) -> ModelWeights:
    """Every matrix as Q8_0 (already quantized ones are kept as they are)."""
    from dualpace.model.quant import QuantizedWeight, quantize_q8_0

    def q(t):
        return t if isinstance(t, QuantizedWeight) else quantize_q8_0(t)

    embed = q(weights.embed_tokens)
    layers = []
    for layer in weights.layers:
        fields = dict(vars(layer))
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            fields[name] = None if fields[name] is None else q(fields[name])
        if layer.moe is not None:  # the experts; the router and shared-expert gate stay dense (they route)
            fields["moe"] = layer.moe.map_matrices(q, routing_fn=lambda m: m)
        layers.append(type(layer)(**fields))
    lm_head = embed if weights.lm_head is weights.embed_tokens else q(weights.lm_head)
    return ModelWeights(embed_tokens=embed, layers=layers, final_norm=weights.final_norm, lm_head=lm_head)


def load_tokenizer_and_config(model: str) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and shape of a model without its weights (for the router)."""
    path = resolve_model_path(model)
    if path.is_dir():
        from dualpace.model.hf_loader import read_hf_config

        return Tokenizer.from_hf_folder(path), read_hf_config(path)
    from dualpace.model.gguf_loader import open_gguf, read_gguf_config

    reader = open_gguf(path)
    return Tokenizer.from_gguf(reader), read_gguf_config(reader)
