"""Fused RMSNorm (with the residual add) and RoPE as Triton kernels: one launch where the torch ops
take several (RMSNorm alone is ~8 ops: cast, pow, mean, add, rsqrt, mul, cast, mul).

- `rms_norm(x, weight, eps)`: one launch per call, one program per token.
- `add_rms_norm(hidden, delta, weight, eps)`: hidden + delta and its norm, in one launch (the
  residual add after the O projection and the post-attention norm).
- `rotary_(qkv, num_rotated_heads, head_dim, cos, sin)`: rotates the q and k heads of a fused
  qkv buffer in place, all of a step's tokens in one launch.
- `silu_mul(gate_up)`: SiLU(gate) * up of the fused gate/up projection's output, one launch.

Each kernel rounds where dualpace.model.transformer's torch ops round (the norm's fp32 result is
cast to the compute dtype before the weight multiplies it; RoPE's cos/sin are cast to the compute
dtype and each product is rounded; SiLU is rounded before the product), so in bf16 they give the torch path's values, and in fp32 they
differ from it by summation order only.

Like dualpace.model.triton_attention, this runs on CUDA and, for the tests, on CPU tensors under
`TRITON_INTERPRET=1` (tests/model/test_triton_fused.py). dualpace.model.attention_backend says
when the engines use it (--fused-kernels; on CUDA by default).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [tokens, hidden] with unit stride along hidden (a copy only when it is not already)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) for x [..., hidden], in x's dtype."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        hidden = rows.shape[1]
        _kernels().rms_norm[(rows.shape[0],)](
            rows, rows, weight.contiguous(), out, out, rows.stride(0), rows.stride(0), out.stride(0), hidden, eps,
            HAS_DELTA=False, BLOCK=_next_power_of_two(hidden))
    return out.view(x.shape)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, rms_norm(hidden + delta)), both in hidden's dtype, from one launch."""
    rows, delta_rows = _rows(hidden), _rows(delta)
    summed = torch.empty(rows.shape, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty_like(summed)
    if rows.shape[0]:
        size = rows.shape[1]
        _kernels().rms_norm[(rows.shape[0],)](
            rows, delta_rows, weight.contiguous(), out, summed, rows.stride(0), delta_rows.stride(0), out.stride(0),
            size, eps, HAS_DELTA=True, BLOCK=_next_power_of_two(size))
    return summed.view(hidden.shape), out.view(hidden.shape)


def rotary_(qkv: torch.Tensor, num_rotated_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate heads [0, num_rotated_heads) of qkv [tokens, heads * head_dim] in place ("rotate
    half" layout); cos/sin: float32 [tokens, head_dim / 2] (dualpace.model.rope.HalfAngles)."""
    num_tokens = qkv.shape[0]
    if qkv.stride(-1) != 1:
        raise ValueError("rotary_: the qkv buffer must have unit stride along its last dimension")
    if head_dim % 2 or cos.shape != (num_tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotary_: cos/sin {tuple(cos.shape)} do not fit {num_tokens} tokens of head_dim {head_dim}")
    if not num_tokens:
        return
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    half = head_dim // 2
    _kernels().rotary[(num_tokens,)](
        qkv, cos, sin, qkv.stride(0), num_rotated_heads, HEAD_DIM=head_dim, HALF=half,
        HALF_PAD=_next_power_of_two(half), HEADS_PAD=_next_power_of_two(num_rotated_heads))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [tokens, 2 * intermediate] (gate first), in its dtype."""
    rows = _rows(gate_up)
    width = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and width:
        block = min(_next_power_of_two(width), SILU_BLOCK)
        _kernels().silu_mul[(rows.shape[0], -(-width // block))](
            rows, out, rows.stride(0), out.stride(0), width, BLOCK=block)
    return out


SILU_BLOCK = 1024  # columns per program: an 8B model's 14336 take 14 programs per token


@functools.cache
def _kernels():
    """Built on first use, so `TRITON_INTERPRET` is read when the kernels are made, not at import."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_delta, stride_out,
                        size, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < size
        x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
        dtype = x.dtype
        if HAS_DELTA:  # the residual add, rounded to the compute dtype as torch's `hidden + delta` is
            x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_delta + cols, mask=valid,
                                            other=0.0).to(tl.float32)).to(dtype)
            tl.store(sum_ptr + row * stride_out + cols, x, mask=valid)
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=0) / size
        normed = (x32 * (1.0 / tl.sqrt(mean_square + eps))).to(dtype)
        weight = tl.load(weight_ptr + cols, mask=valid, other=0.0)
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype)
        tl.store(out_ptr + row * stride_out + cols, out, mask=valid)

    @triton.jit
    def rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_token, num_heads, HEAD_DIM: tl.constexpr,
                      HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS_PAD)
        pairs = tl.arange(0, HALF_PAD)
        pair_valid = pairs < HALF
        valid = (heads[:, None] < num_heads) & pair_valid[None, :]
        first = qkv_ptr + token * stride_token + heads[:, None] * HEAD_DIM + pairs[None, :]
        x1 = tl.load(first, mask=valid, other=0.0)
        x2 = tl.load(first + HALF, mask=valid, other=0.0)
        dtype = x1.dtype
        # cos/sin in the compute dtype, and each product rounded to it, as `x * cos + rotated * sin` is
        cos = tl.load(cos_ptr + token * HALF + pairs, mask=pair_valid, other=0.0).to(dtype).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + token * HALF + pairs, mask=pair_valid, other=0.0).to(dtype).to(tl.float32)[None, :]
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        out1 = ((a1 * cos).to(dtype).to(tl.float32) - (a2 * sin).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)).to(dtype)
        tl.store(first, out1, mask=valid)
        tl.store(first + HALF, out2, mask=valid)

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < width
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=valid, other=0.0)
        up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=valid, other=0.0)
        g = gate.to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded as F.silu's result is
        tl.store(out_ptr + row * stride_out + cols, (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
                 mask=valid)

    return _Kernels(rms_norm_kernel, rotary_kernel, silu_mul_kernel)


class _Kernels(NamedTuple):
    """The jitted kernels, made together."""

    rms_norm: object
    rotary: object
    silu_mul: object
