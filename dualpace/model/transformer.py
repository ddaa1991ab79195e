"""A decoder of any family in dualpace.model.config.FAMILIES, split into stages.

The forward pass is exposed as stages callable on their own, so that dense
layers and attention can run in different places (Dense Assist keeps the
residual stream and the dense weights on the GPU while attention runs on the
CPU beside its KV):

    embed -> for each layer: pre_attention -> (attention elsewhere) -> post_attention
          -> final norm + LM head

The model holds weights only; KV storage and attention live in dualpace.kv and
dualpace.model.attention.

On a CPU the stages run through dualpace.model.cpu_kernels (a streaming GEMV for up to 8 rows,
fused RMSNorm / RoPE / SiLU*up, residual adds fused into the output projections, one variant per
instruction set); on CUDA, RMSNorm (with the residual add before the post-attention norm), RoPE and
SiLU * up are fused Triton kernels (dualpace.model.triton_fused, --fused-kernels); elsewhere, or with
the kernels turned off, they are plain torch ops. All paths compute the same function; the torch
path is the reference.

The compute dtype (activations, norms, bias, KV) is the dtype of the norm weights; a matrix may
be stored in another dtype (bf16 matrices with fp32 compute, `ModelWeights.to(...,
matrix_dtype=)`) or be a quantized-weight object (dualpace/model/KERNELS.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dualpace.model import cpu_kernels, triton_fused
from dualpace.model.attention_backend import uses_fused_triton
from dualpace.model.config import ModelConfig
from dualpace.model.cpu_moe import GroupedExperts, moe_mlp_on_kernels
from dualpace.model.moe import MoeWeights, moe_mlp, swiglu
from dualpace.model.rope import HalfAngles, RotaryEmbedding, apply_rotary

# x @ w^T (+ bias) with torch ops for a tensor of any dtype or a quantized-weight object
linear = cpu_kernels.torch_linear


def _torch_matmul(x: torch.Tensor, weight, kernel_rows: torch.Tensor | None) -> torch.Tensor:
    return linear(x, weight)


@dataclass
class LayerWeights:
    """One decoder layer. Q, K, V are fused into one matrix, as are gate and up."""

    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2)
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    down_proj: torch.Tensor | None  # [hidden, intermediate]; None in a mixture-of-experts layer
    q_norm: torch.Tensor | None = None  # [head_dim], RMSNorm weight of every q head (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim], of every k head
    # Gemma's sandwich norms: over the attention output and over the MLP output, before each residual add
    attention_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    moe: MoeWeights | None = None  # the routed experts of a sparse layer (dualpace.model.moe)

    def weight_tensors(self) -> list:
        """Every tensor or weight object the layer holds."""
        held = [t for k, t in vars(self).items() if k != "moe" and t is not None]
        return held + ([] if self.moe is None else self.moe.matrices())


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed_tokens when tied

    def to(self, device: torch.device | str, dtype: torch.dtype,
           matrix_dtype: torch.dtype | None = None) -> "ModelWeights":
        """On `device`, vectors (norms, bias) in `dtype` and matrices (projections, embedding, LM
        head) in `matrix_dtype` (default `dtype`). A quantized-weight object is moved with its
        own .to(device=, dtype=the compute dtype) (it stays itself on the CPU)."""
        def move(t, as_dtype: torch.dtype):
            if t is None:
                return None
            if not isinstance(t, torch.Tensor):
                return t.to(device=device, dtype=dtype)
            return t.to(device=device, dtype=as_dtype).contiguous()

        matrix_dtype = matrix_dtype or dtype
        embed = move(self.embed_tokens, matrix_dtype)
        tied = self.lm_head is self.embed_tokens
        def move_moe(moe: MoeWeights | None) -> MoeWeights | None:
            # the router and the shared expert's gate decide the routing: kept in the compute dtype
            return None if moe is None else moe.map_matrices(lambda m: move(m, matrix_dtype),
                                                             routing_fn=lambda m: move(m, dtype))

        return ModelWeights(
            embed_tokens=embed,
            layers=[LayerWeights(**{k: move_moe(v) if k == "moe" else move(v, matrix_dtype if k in MATRIX_FIELDS
                                                                           else dtype)
                                    for k, v in vars(layer).items()}) for layer in self.layers],
            final_norm=move(self.final_norm, dtype),
            lm_head=embed if tied else move(self.lm_head, matrix_dtype),
        )

    def num_bytes(self) -> int:
        weights = [self.embed_tokens, self.final_norm]
        if self.lm_head is not self.embed_tokens:
            weights.append(self.lm_head)
        for layer in self.layers:
            weights.extend(layer.weight_tensors())
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.num_bytes() for t in weights)


MATRIX_FIELDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LayerKindAngles(NamedTuple):
    """A step's RoPE angles for global layers and for windowed layers with their own theta."""

    full: object
    local: object


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as the reference implementation does."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Transformer:
    """Weights plus the stage functions of the forward pass. Holds no KV."""

    def __init__(self, config: ModelConfig, weights: ModelWeights):
        self.config = config
        self.weights = weights
        self.device = weights.final_norm.device
        self.dtype = weights.final_norm.dtype  # the compute dtype
        self.rotary = RotaryEmbedding(config, self.device)
        self.local_rotary = None  # windowed layers' own theta (Gemma 3)
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(dataclasses.replace(config, rope_theta=config.local_rope_theta),
                                                self.device)
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        # Triton's fused norm/RoPE (CUDA; CPU tensors only under the interpreter, in tests) replace the CPU kernels
        self._fused_triton = uses_fused_triton(self.device) and triton_fused.supported(weights.final_norm)
        self._kernel_capable = (self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32)
                                and not self._fused_triton)
        # (MoE layer, kernel variant) -> its experts for the grouped kernel call (None: not runnable there)
        self._grouped: dict[tuple[int, str], GroupedExperts | None] = {}

    @property
    def kernel_capable(self) -> bool:
        """Whether the norms and projections go to the CPU kernels when they are loaded."""
        return self._kernel_capable

    def _kernels(self) -> cpu_kernels.Kernels | None:
        return cpu_kernels.get() if self._kernel_capable else None

    def grouped_experts(self, layer_index: int, kernels: cpu_kernels.Kernels) -> GroupedExperts | None:
        """The layer's experts for the grouped kernel call, built on first use (per kernel variant)."""
        key = (layer_index, kernels.variant)
        if key not in self._grouped:
            self._grouped[key] = GroupedExperts.build(kernels, self.weights.layers[layer_index].moe)
        return self._grouped[key]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [num_tokens] -> hidden states [num_tokens, hidden]."""
        embedded = F.embedding(token_ids, self.weights.embed_tokens)
        if self.config.embedding_scale is not None:  # in the embedding's dtype, as transformers does
            embedded = embedded * torch.tensor(self.config.embedding_scale, dtype=embedded.dtype)
        return embedded.to(self.dtype)

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this step's positions, computed once and shared by all layers (a
        HalfAngles tuple when the CPU kernels are in use; a LayerKindAngles pair where windowed layers
        have their own theta; pass it back to pre_attention as is)."""
        if self.local_rotary is not None:
            return LayerKindAngles(*(self._angles(rotary, positions) for rotary in (self.rotary, self.local_rotary)))
        return self._angles(self.rotary, positions)

    def _angles(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        if self._kernels() is not None or self._fused_triton:
            return rotary.half_angles(positions)
        return rotary.cos_sin(positions, self.dtype)

    def pre_attention(
        self, layer_index: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        kernel_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, fused QKV projection, q/k norms where the model has them, and RoPE.

        Returns q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim]. kernel_rows: rows
        that get the CPU kernels' products whatever the others get (Kernels.linear).
        """
        layer = self.weights.layers[layer_index]
        cfg = self.config
        num_tokens = hidden.shape[0]
        if isinstance(rope, LayerKindAngles):
            rope = rope.local if cfg.layer_window(layer_index) is not None else rope.full
        kernels = self._kernels()
        on_kernels = kernels is not None and isinstance(rope, HalfAngles)
        if on_kernels:
            x = kernels.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = kernels.linear(x, layer.qkv_proj, layer.qkv_bias, kernel_rows=kernel_rows)
        else:
            qkv = linear(self._rms_norm(hidden, layer.input_norm), layer.qkv_proj, layer.qkv_bias)
        q, k, v = qkv.split((self._q_size, self._kv_size, self._kv_size), dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:  # q, k are views of qkv: normalized in place
            q.copy_(rms_norm(q, layer.q_norm, cfg.rms_norm_eps))
            k.copy_(rms_norm(k, layer.k_norm, cfg.rms_norm_eps))
        if cfg.rotary_dim is None and on_kernels:  # q and k heads rotated in place
            kernels.rotary_(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, rope.cos, rope.sin)
            return q, k, v
        if (cfg.rotary_dim is None and self._fused_triton and isinstance(rope, HalfAngles)
                and qkv.dtype == self.dtype):  # in place, one launch
            triton_fused.rotary_(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, rope.cos, rope.sin)
            return q, k, v
        cos, sin = rope.full(self.dtype) if isinstance(rope, HalfAngles) else rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def post_attention(self, layer_index: int, hidden: torch.Tensor, attention_out: torch.Tensor,
                       kernel_rows: torch.Tensor | None = None) -> torch.Tensor:
        """O projection + residual, then norm, SwiGLU MLP (or the layer's mixture of experts) +
        residual. attention_out: [T, num_heads * head_dim]."""
        layer = self.weights.layers[layer_index]
        kernels = self._kernels()
        if self.config.family.gemma:
            return self._gemma_post_attention(layer, hidden, attention_out, kernels, kernel_rows)
        if kernels is not None:
            hidden = kernels.linear(attention_out, layer.o_proj, residual=hidden, kernel_rows=kernel_rows)
            x = kernels.rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps)
            if layer.moe is not None:
                return hidden + moe_mlp_on_kernels(x, layer.moe, self.config.moe, kernels,
                                                   self.grouped_experts(layer_index, kernels), kernel_rows)
            gated = kernels.silu_mul(kernels.linear(x, layer.gate_up_proj, kernel_rows=kernel_rows))
            return kernels.linear(gated, layer.down_proj, residual=hidden, kernel_rows=kernel_rows)
        silu_mul = None
        if self._fused_triton:  # the residual add and the norm in one launch, then SiLU * up in one
            hidden, x = triton_fused.add_rms_norm(hidden, linear(attention_out, layer.o_proj),
                                                  layer.post_attention_norm, self.config.rms_norm_eps)
            silu_mul = triton_fused.silu_mul
        else:
            hidden = hidden + linear(attention_out, layer.o_proj)
            x = rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps)
        if layer.moe is not None:
            return hidden + moe_mlp(x, layer.moe, self.config.moe, _torch_matmul, silu_mul=silu_mul)
        return hidden + swiglu(x, layer.gate_up_proj, layer.down_proj, _torch_matmul, None, silu_mul)

    def _gemma_post_attention(self, layer: LayerWeights, hidden: torch.Tensor, attention_out: torch.Tensor,
                              kernels: cpu_kernels.Kernels | None, kernel_rows: torch.Tensor | None) -> torch.Tensor:
        """Sandwich norms and a GELU-tanh gate: hidden + norm(O(attn)), then + norm(MLP(norm(hidden)))."""
        eps = self.config.rms_norm_eps

        def project(x: torch.Tensor, weight) -> torch.Tensor:
            return linear(x, weight) if kernels is None else kernels.linear(x, weight, kernel_rows=kernel_rows)

        hidden = hidden + rms_norm(project(attention_out, layer.o_proj), layer.attention_out_norm, eps)
        gate, up = project(rms_norm(hidden, layer.post_attention_norm, eps), layer.gate_up_proj).chunk(2, dim=-1)
        mlp = project(F.gelu(gate, approximate="tanh") * up, layer.down_proj)
        return hidden + rms_norm(mlp, layer.mlp_out_norm, eps)

    def logits(self, hidden: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """Final norm and LM head: hidden [N, hidden] -> logits [N, vocab] in float32. invariant:
        every row gets the CPU kernels' product where they take N rows (Kernels.linear)."""
        kernels = self._kernels()
        if kernels is not None:
            x = kernels.rms_norm(hidden, self.weights.final_norm, self.config.rms_norm_eps)
            rows = torch.arange(x.shape[0]) if invariant else None
            return kernels.linear(x, self.weights.lm_head, out_dtype=torch.float32, kernel_rows=rows)
        x = self._rms_norm(hidden, self.weights.final_norm)
        return linear(x, self.weights.lm_head).float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused_triton:
            return triton_fused.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)
