"""Tensor-level wrappers of the CPU kernels' elementwise, KV-scatter and decode-attention entry points
(cpu_kernels.cpp), mixed into cpu_kernels.Kernels, which holds the loaded library as `self.lib`.
Inputs must be on the CPU, bf16 or fp32, rows with unit inner stride."""

from __future__ import annotations

import torch


class ElementwiseAndAttentionOps:
    lib: object  # the loaded ctypes library (set by Kernels)

    # -- elementwise ------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=x.dtype)
        weight = weight.to(x.dtype).contiguous()
        fn = self.lib.dp_rms_norm_bf16 if x.dtype == torch.bfloat16 else self.lib.dp_rms_norm_f32
        fn(x.data_ptr(), rows, hidden, x.stride(0), weight.data_ptr(), eps, out.data_ptr())
        return out

    def rotary_(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first `num_heads` heads of each contiguous row of qkv in place; cos/sin
        float32 [rows, head_dim / 2]."""
        fn = self.lib.dp_rotary_bf16 if qkv.dtype == torch.bfloat16 else self.lib.dp_rotary_f32
        fn(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, head_dim, cos.data_ptr(), sin.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        fn = self.lib.dp_silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else self.lib.dp_silu_mul_f32
        fn(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def first_max_ids(self, scores: torch.Tensor) -> torch.Tensor | None:
        """torch.max(scores, dim=1).indices for float32 scores [rows, vocab] (the lowest column
        among ties), in one native pass per row; None for a row holding a NaN (torch decides then)."""
        if scores.stride(-1) != 1:
            scores = scores.contiguous()
        ids = torch.empty(scores.shape[0], dtype=torch.int64)
        self.lib.dp_first_max_rows_f32(scores.data_ptr(), scores.shape[0], scores.shape[1], scores.stride(0),
                                       ids.data_ptr())
        return None if bool((ids < 0).any()) else ids

    def kv_write(self, k_layer: torch.Tensor, v_layer: torch.Tensor, slot_ids: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> bool:
        """Scatter k, v [T, kv_heads, head_dim] (rows with contiguous heads) into the layer's slots.
        Returns False (nothing written) when the layout does not fit; the caller then uses torch."""
        row = k_layer.shape[-2] * k_layer.shape[-1]
        if k.shape[0] == 0:
            return True
        if (k.dtype != k_layer.dtype or v.dtype != k_layer.dtype or k.stride(0) != v.stride(0)
                or k[0].numel() != row or not (k[0].is_contiguous() and v[0].is_contiguous())
                or slot_ids.dtype != torch.long or not slot_ids.is_contiguous()):
            return False
        esize = k.element_size()
        num_slots = k_layer.numel() // row
        if self.lib.dp_kv_write(k.data_ptr(), v.data_ptr(), k.shape[0], k.stride(0) * esize, slot_ids.data_ptr(),
                                num_slots, k_layer.data_ptr(), v_layer.data_ptr(), row * esize):
            raise IndexError(f"kv write: a slot id is outside [0, {num_slots})")
        return True

    # -- attention --------------------------------------------------------------------------

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
        """As dualpace.model.attention.decode_attention; None when this shape is not supported."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        if (q.dtype != k_cache.dtype or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or q.stride(2) != 1 or q.stride(1) != head_dim or block_tables.dtype != torch.long
                or context_lens.dtype != torch.long):
            return None
        tables = block_tables.contiguous()
        lens = context_lens.contiguous()
        out = torch.empty((batch, num_heads * head_dim), dtype=q.dtype)
        fn = self.lib.dp_decode_attention_bf16 if q.dtype == torch.bfloat16 else self.lib.dp_decode_attention_f32
        status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                    tables.data_ptr(),
                    tables.shape[1] if tables.dim() == 2 else 0, lens.data_ptr(), batch, k_cache.shape[1],
                    num_kv_heads, num_heads // num_kv_heads, head_dim, scale, out.data_ptr(), out.stride(0))
        if status == -2:
            raise IndexError("decode attention: a context length or block id is out of range")
        return out if status == 0 else None
