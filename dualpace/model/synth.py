"""Synthetic random-weight checkpoints in Hugging Face format.

A preset names a ModelConfig plus how to initialise it. Tiny presets (fp32;
linear weights and qkv biases std 0.2, embeddings / lm_head std 0.6, norm
weights 1 + N(0, 0.1)) give clear greedy top-1 margins for parity tests (mean
top1-top2 logit gap about 1.5); real-shape presets (bf16, std 0.02) are for
speed benchmarks only.

The folder written holds config.json, generation_config.json, tokenizer.json,
tokenizer_config.json and either model.safetensors or, above `max_shard_bytes`,
numbered shards with model.safetensors.index.json. Weights are drawn tensor by
tensor (in chunks) from one CPU torch.Generator, so a seed gives identical
bytes and peak memory stays near one shard.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from dualpace.errors import InvalidArgument
from dualpace.model import synth_tokenizer as stok
from dualpace.model.config import ModelConfig, RopeScaling
from dualpace.model.hf_layout import TensorSpec, count_parameters, tensor_specs  # noqa: F401 (re-exported)
from dualpace.model.moe_spec import MoeSpec

DEFAULT_MAX_SHARD_BYTES = 1 << 30
_RANDOM_CHUNK_NUM_ELEMENTS = 1 << 22
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Preset:
    """A named synthetic model: its shape and how its weights are drawn."""

    name: str
    description: str
    config: ModelConfig
    weight_std: float
    embedding_std: float
    norm_noise_std: float
    default_dtype: torch.dtype
    is_large: bool


# Larger than the linear std so the final logits spread out: greedy margins of ~1.5, not ~0.5.
TINY_EMBEDDING_STD = 0.6
_TOKENS = dict(bos_token_id=stok.BOS_ID, eos_token_ids=stok.EOS_IDS)


def _tiny(name: str, description: str, **config) -> Preset:
    return Preset(
        name, description, ModelConfig(**config, **_TOKENS), weight_std=0.2, embedding_std=TINY_EMBEDDING_STD,
        norm_noise_std=0.1, default_dtype=torch.float32, is_large=False,
    )


def _large(name: str, description: str, **config) -> Preset:
    return Preset(
        name, description, ModelConfig(**config, **_TOKENS), weight_std=0.02, embedding_std=0.02,
        norm_noise_std=0.0, default_dtype=torch.bfloat16, is_large=True,
    )


_TINY_LLAMA = dict(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
)

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        _tiny("tiny-llama", "llama, GQA 4q/2kv, tied embeddings", **_TINY_LLAMA, tie_word_embeddings=True),
        _tiny("tiny-llama-untied", "llama, GQA 4q/2kv, separate lm_head", **_TINY_LLAMA),
        _tiny(
            "tiny-qwen2", "qwen2, qkv bias, GQA 6q/2kv, vocab 600, tied, theta 1e6",
            architecture="qwen2", vocab_size=600, hidden_size=96, intermediate_size=192, num_layers=2,
            num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=1024, tie_word_embeddings=True, qkv_bias=True,
        ),
        _tiny(
            "tiny-mistral", "mistral, MQA 4q/1kv, head_dim 32 != hidden/heads, untied",
            architecture="mistral", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2,
            num_heads=4, num_kv_heads=1, head_dim=32, max_position_embeddings=1024,
        ),
        _tiny(
            "tiny-llama3-rope", "llama, llama3 rope scaling (factor 8, original 64), theta 5e5, tied",
            **_TINY_LLAMA, rope_theta=500000.0, tie_word_embeddings=True,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
        ),
        _tiny(
            "tiny-qwen3", "qwen3, q/k RMSNorm, head_dim 32 != hidden/heads, GQA 4q/2kv, tied, theta 1e6",
            **{**_TINY_LLAMA, "head_dim": 32, "architecture": "qwen3"}, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=True, qk_norm=True,
        ),
        _tiny(
            "tiny-phi3", "phi3, fused qkv and gate_up, partial rotary (12 of 16 dims), untied",
            **{**_TINY_LLAMA, "architecture": "phi3"}, rotary_dim=12,
        ),
        _tiny(
            "tiny-mistral-swa", "mistral, sliding window of 12 tokens, GQA 4q/2kv, untied",
            **{**_TINY_LLAMA, "architecture": "mistral"}, sliding_window=12,
        ),
        _tiny(
            "tiny-gemma3", "gemma3_text, windowed layers 0, 1, 3 (12 tokens, theta 1e4), global layer 2 (theta 1e6)",
            **{**_TINY_LLAMA, "head_dim": 32, "num_layers": 4, "architecture": "gemma3_text"}, rms_norm_eps=1e-6,
            rope_theta=1e6, local_rope_theta=1e4, sliding_window=12, window_layers=(True, True, False, True),
            query_pre_attn_scalar=24.0, qk_norm=True, tie_word_embeddings=True,
        ),
        _tiny(
            "tiny-mixtral", "mixtral, 8 experts top-2, GQA 4q/2kv, untied",
            architecture="mixtral", vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
            moe=MoeSpec(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=96, norm_topk_prob=True),
        ),
        _tiny(
            "tiny-qwen2-moe", "qwen2_moe, 8 experts top-2 unnormalised, gated shared expert, layer 0 dense, tied",
            architecture="qwen2_moe", vocab_size=600, hidden_size=64, intermediate_size=128, num_layers=3,
            num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=1024, tie_word_embeddings=True, qkv_bias=True,
            moe=MoeSpec(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=48, norm_topk_prob=False,
                        shared_expert_intermediate_size=80, shared_expert_gated=True, mlp_only_layers=(0,)),
        ),
        _tiny(
            "tiny-qwen3-moe", "qwen3_moe, q/k RMSNorm, 8 experts top-2 normalised, every 2nd layer sparse, tied",
            **{**_TINY_LLAMA, "head_dim": 32, "num_layers": 4, "architecture": "qwen3_moe"}, rms_norm_eps=1e-6,
            rope_theta=1e6, tie_word_embeddings=True, qk_norm=True,
            moe=MoeSpec(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=64, norm_topk_prob=True,
                        decoder_sparse_step=2),
        ),
        _large(
            "qwen3-30b-a3b-4l", "Qwen3-30B-A3B layer shapes (128 experts top-8, expert FFN 768, hidden 2048, "
            "32q/4kv heads of 128), 4 of its 48 layers (random weights, speed only)",
            architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=4,
            num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True,
            moe=MoeSpec(num_experts=128, num_experts_per_tok=8, expert_intermediate_size=768, norm_topk_prob=True),
        ),
        _large(
            "qwen2.5-0.5b", "Qwen2.5-0.5B shapes (random weights, speed only)",
            architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
            num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=True,
        ),
        _large(
            "llama-3.2-1b", "Llama-3.2-1B shapes (random weights, speed only)",
            architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
            num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=131072, tie_word_embeddings=True,
            rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        ),
        _large(
            "qwen3-1.7b", "Qwen3-1.7B shapes (random weights, speed only)",
            architecture="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
            num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        ),
        _large(
            "phi-4-mini", "Phi-4-mini shapes, its 4k original context, plain RoPE (random weights, speed only)",
            architecture="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_layers=32,
            num_heads=24, num_kv_heads=8, head_dim=128, rotary_dim=96, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=4096, tie_word_embeddings=True,
        ),
        _large(
            "gemma-3-1b", "Gemma-3-1B shapes (random weights, speed only)",
            architecture="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
            num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6, local_rope_theta=1e4,
            sliding_window=512, window_layers=tuple(bool((i + 1) % 6) for i in range(26)), query_pre_attn_scalar=256.0,
            max_position_embeddings=32768, tie_word_embeddings=True, qk_norm=True,
        ),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; InvalidArgument naming the known ones otherwise."""
    if name not in PRESETS:
        raise InvalidArgument("preset", f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def _random_tensor(spec: TensorSpec, preset: Preset, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Draw one tensor chunk by chunk, so fp32 scratch stays small for huge embeddings."""
    mean, std = {
        "norm": (0.0 if preset.config.family.gemma else 1.0, preset.norm_noise_std),  # Gemma stores w - 1
        "embedding": (0.0, preset.embedding_std),
        "linear": (0.0, preset.weight_std),
    }[spec.kind]
    out = torch.empty(spec.num_elements, dtype=dtype)
    for start in range(0, spec.num_elements, _RANDOM_CHUNK_NUM_ELEMENTS):
        stop = min(start + _RANDOM_CHUNK_NUM_ELEMENTS, spec.num_elements)
        chunk = torch.randn(stop - start, generator=generator, dtype=torch.float32)
        out[start:stop] = chunk.mul_(std).add_(mean)
    return out.view(spec.shape)


def _group_into_shards(specs: list[TensorSpec], bytes_per_element: int, max_shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    num_shard_bytes = 0
    for spec in specs:
        num_bytes = spec.num_elements * bytes_per_element
        if shards[-1] and num_shard_bytes + num_bytes > max_shard_bytes:
            shards.append([])
            num_shard_bytes = 0
        shards[-1].append(spec)
        num_shard_bytes += num_bytes
    return shards


def _prepare_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise InvalidArgument("out", f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise InvalidArgument("out", f"{out_dir} is not empty (use --force to overwrite)")
        # Stale weights from an earlier (differently sharded) run would confuse loaders.
        for stale in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n")


def _write_weights(
    preset: Preset, out_dir: Path, seed: int, dtype: torch.dtype, max_shard_bytes: int,
    progress: Callable[[str], None] | None,
) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    bytes_per_element = torch.empty((), dtype=dtype).element_size()
    specs = tensor_specs(preset.config)
    shards = _group_into_shards(specs, bytes_per_element, max_shard_bytes)
    num_shards = len(shards)
    if progress is not None:
        num_total_bytes = sum(spec.num_elements for spec in specs) * bytes_per_element
        progress(f"{preset.name}: writing {num_total_bytes / 1e6:.0f} MB of weights in {num_shards} file(s) to {out_dir}")
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = "model.safetensors" if num_shards == 1 else f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        tensors = {spec.name: _random_tensor(spec, preset, dtype, generator) for spec in shard}
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update({spec.name: file_name for spec in shard})
        if progress is not None:
            num_shard_bytes = sum(spec.num_elements for spec in shard) * bytes_per_element
            progress(f"{preset.name}: wrote {file_name} ({len(shard)} tensors, {num_shard_bytes / 1e6:.0f} MB)")
        del tensors
    if num_shards > 1:
        total_size = sum(spec.num_elements for spec in specs) * bytes_per_element
        _write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_synthetic_checkpoint(
    preset: str,
    out_dir: Path,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    *,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the preset's random-weight Hugging Face folder to `out_dir`; returns it.

    `dtype` defaults to the preset's (fp32 tiny, bf16 large). A non-empty
    `out_dir` is refused unless `force`. `progress` receives one line per
    weights file written; None means stderr for large presets, silence for tiny.
    """
    chosen = get_preset(preset)
    dtype = dtype or chosen.default_dtype
    if dtype not in _DTYPE_NAMES:
        raise InvalidArgument("dtype", f"unsupported dtype {dtype}; use one of {', '.join(_DTYPE_NAMES.values())}")
    if max_shard_bytes <= 0:
        raise InvalidArgument("max_shard_bytes", f"must be positive, got {max_shard_bytes}")
    if progress is None and chosen.is_large:
        progress = _print_progress
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, force)
    config = chosen.config

    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = _DTYPE_NAMES[dtype]
    _write_json(out_dir / "config.json", hf_config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids), "pad_token_id": stok.PAD_ID},
    )
    tokenizer = stok.build_tokenizer(config.vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", stok.tokenizer_config_dict(config.max_position_embeddings))
    _write_weights(chosen, out_dir, seed, dtype, max_shard_bytes, progress)
    return out_dir
