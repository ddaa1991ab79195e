"""Rotary position embeddings (the Hugging Face "rotate half" layout), with llama3 scaling (from
config.json or a GGUF's rope_freqs factors), LongRoPE's short factors and cos/sin factor, and partial
rotation (the first rotary_dim dims of a head)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dualpace.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The per-pair rotation frequencies [rotary_dim / 2] in float32, llama3 scaling applied."""
    dims = config.num_rotary_dims
    exponents = torch.arange(0, dims, 2, dtype=torch.int64).float() / dims
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_freq_factors is not None:
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`; short ones are kept; the band
    # between is interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class HalfAngles(NamedTuple):
    """cos and sin of a step's angles as float32 [num_tokens, head_dim / 2]: the form the CPU
    kernels take (the "rotate half" layout repeats each angle in both halves of a head)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def full(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The [num_tokens, 1, head_dim] form apply_rotary takes."""
        cos = torch.cat((self.cos, self.cos), dim=-1)[:, None, :]
        sin = torch.cat((self.sin, self.sin), dim=-1)[:, None, :]
        return cos.to(dtype), sin.to(dtype)


class RotaryEmbedding:
    """Computes cos/sin for a step's positions once; every layer reuses them."""

    def __init__(self, config: ModelConfig, device: torch.device):
        self.inv_freq = inverse_frequencies(config).to(device)
        self.attention_factor = config.rope_attention_factor  # LongRoPE scales cos and sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [num_tokens, 1, head_dim], for integer positions [num_tokens]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return self._scaled(angles.cos()).to(dtype), self._scaled(angles.sin()).to(dtype)

    def _scaled(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.attention_factor == 1.0 else values * self.attention_factor

    def half_angles(self, positions: torch.Tensor) -> HalfAngles:
        """cos and sin [num_tokens, head_dim / 2] in float32, for the CPU kernels."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return HalfAngles(self._scaled(freqs.cos()), self._scaled(freqs.sin()))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by the given angles [num_tokens, 1, rotary_dim]:
    the first rotary_dim dims of each head; the rest pass through."""
    dims = cos.shape[-1]
    if dims < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dims], cos, sin), x[..., dims:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
