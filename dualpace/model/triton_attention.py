"""Paged attention that reads the KV blocks in place, for a whole step in one launch (Triton).

One kernel serves decode tokens and prefill chunks alike: each sequence brings `num_new`
query tokens at positions [start_pos, start_pos + num_new) and attends causally to every
cached token before them, block by block through its block table, with an online softmax.
Nothing is gathered into a dense [context, heads, dim] copy, sequences of different lengths
share the launch, and a chunk may start anywhere (inside a cached prefix, mid-block).

GQA/MQA: a program owns one KV head of one sequence's query tile and stacks that head's
`group` query heads as rows, so each K/V block is read once per group, not once per query head.

This runs where Triton runs: on CUDA, and on CPU tensors under `TRITON_INTERPRET=1` (how the
CPU machines test its logic, tests/model/test_triton_attention.py). The engines use it on CUDA
only (dualpace.model.attention_backend); the CPU engine keeps its own kernels.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

MIN_DOT_DIM = 16  # tl.dot wants every dimension >= 16


@dataclass(frozen=True)
class VarlenBatch:
    """Where each sequence's query tokens and KV live, as tensors on the step's device.

    query_start: [S + 1] offsets into the step's tokens (sequence s owns rows
    query_start[s]:query_start[s + 1]); start_pos: [S] tokens already cached before them;
    block_tables: [S, max_blocks] block ids (rows padded with any valid id)."""

    query_start: torch.Tensor
    start_pos: torch.Tensor
    block_tables: torch.Tensor
    max_new_tokens: int


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the kernel handles: power-of-two KV block size >= 16, group <= 16, fp32/bf16/fp16."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    return (block_size >= MIN_DOT_DIM and block_size & (block_size - 1) == 0 and group <= MIN_DOT_DIM
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.dtype == k_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: VarlenBatch,
                    scale: float) -> torch.Tensor:
    """q: [T, num_heads, head_dim] (all sequences' new tokens, K/V already written);
    k_cache/v_cache: one layer, [num_blocks, block_size, kv_heads, head_dim]. Returns
    [T, num_heads * head_dim] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = _next_power_of_two(group)
    # Rows of a tile: tokens x group heads, at least 16 for tl.dot.
    tile_tokens = max(1, MIN_DOT_DIM // group_pad)
    if batch.max_new_tokens > tile_tokens:
        tile_tokens = max(tile_tokens, min(64 // group_pad, _next_power_of_two(batch.max_new_tokens)))
    head_dim_pad = max(MIN_DOT_DIM, _next_power_of_two(head_dim))
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_tables = batch.block_tables.to(torch.int32).contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = batch.start_pos.shape[0]
    grid = (num_seqs, math.ceil(batch.max_new_tokens / tile_tokens), num_kv_heads)
    _kernel()[grid](
        q, k_cache, v_cache, out, block_tables, batch.query_start.to(torch.int32).contiguous(),
        batch.start_pos.to(torch.int32).contiguous(),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale,
        GROUP=group, GROUP_PAD=group_pad, TILE_TOKENS=tile_tokens, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        # fp32 inputs: exact fp32 dots (no TF32), so CUDA matches the CPU to 1e-5. The interpreter's
        # bf16/fp16 dots are wrong (triton 3.9), so under it half inputs are upcast for the dots too.
        IEEE_FP32=q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
    )
    return out.view(num_tokens, num_heads * head_dim)


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


@functools.cache
def _kernel():
    """Built on first use, so `TRITON_INTERPRET` is read when the kernel is made, not at import."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, query_start_ptr, start_pos_ptr,
        stride_q_token, stride_q_head, stride_kv_block, stride_kv_slot, stride_kv_head,
        stride_table, stride_out_token, stride_out_head, scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IEEE_FP32: tl.constexpr,
    ):
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        first_token = tl.load(query_start_ptr + seq)
        num_new = tl.load(query_start_ptr + seq + 1) - first_token
        if tile * TILE_TOKENS < num_new:
            start_pos = tl.load(start_pos_ptr + seq)
            rows = tl.arange(0, TILE_TOKENS * GROUP_PAD)
            token = tile * TILE_TOKENS + rows // GROUP_PAD
            head = kv_head * GROUP + rows % GROUP_PAD
            row_valid = (token < num_new) & (rows % GROUP_PAD < GROUP)
            dims = tl.arange(0, HEAD_DIM_PAD)
            dim_valid = dims < HEAD_DIM
            q_offsets = (first_token + token)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
            queries = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
            query_pos = start_pos + token
            # The tile's last query sees positions < end_pos; blocks past it are never read.
            end_pos = start_pos + tl.minimum((tile + 1) * TILE_TOKENS, num_new)
            row_max = tl.full((TILE_TOKENS * GROUP_PAD,), float("-inf"), tl.float32)
            row_sum = tl.zeros((TILE_TOKENS * GROUP_PAD,), tl.float32)
            acc = tl.zeros((TILE_TOKENS * GROUP_PAD, HEAD_DIM_PAD), tl.float32)
            slots = tl.arange(0, BLOCK_SIZE)
            for block_index in range(0, tl.cdiv(end_pos, BLOCK_SIZE)):
                block_id = tl.load(block_tables_ptr + seq * stride_table + block_index).to(tl.int64)
                kv_offsets = (block_id * stride_kv_block + slots[:, None] * stride_kv_slot
                              + kv_head * stride_kv_head + dims[None, :])
                keys = tl.load(k_ptr + kv_offsets, mask=dim_valid[None, :], other=0.0)
                values = tl.load(v_ptr + kv_offsets, mask=dim_valid[None, :], other=0.0)
                if IEEE_FP32:
                    scores = tl.dot(queries.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
                else:
                    scores = tl.dot(queries, tl.trans(keys))
                key_pos = block_index * BLOCK_SIZE + slots
                visible = (key_pos[None, :] <= query_pos[:, None]) & row_valid[:, None]
                scores = tl.where(visible, scores * scale, float("-inf"))
                new_max = tl.maximum(row_max, tl.max(scores, 1))
                safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing visible yet
                probs = tl.exp(scores - safe_max[:, None])
                rescale = tl.exp(row_max - safe_max)
                row_sum = row_sum * rescale + tl.sum(probs, 1)
                if IEEE_FP32:
                    update = tl.dot(probs, values.to(tl.float32), input_precision="ieee")
                else:
                    update = tl.dot(probs.to(values.dtype), values)
                acc = acc * rescale[:, None] + update
                row_max = new_max
            result = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
            out_offsets = ((first_token + token)[:, None] * stride_out_token + head[:, None] * stride_out_head
                           + dims[None, :])
            tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty),
                     mask=row_valid[:, None] & dim_valid[None, :])

    return paged_attention_kernel
