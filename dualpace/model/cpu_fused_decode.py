"""The whole decode step of a CPU model in one kernel call (dp_decode_layers_* in cpu_kernels.cpp).

All decoder layers of a decode-only step of at most `max_rows` sequences (Kernels.dense_max_rows when a
matrix is a dense tensor of the compute dtype, which oneDNN takes beyond that: LINEAR_MAX_ROWS,
BF16_DOT_MAX_ROWS for bf16 on the vdpbf16ps GEMV, or AMX_MAX_ROWS for bf16 where the kernels run AMX
tiles; MIXED_MAX_ROWS when
every matrix is block-quantized or of another dtype than the activations, where the per-stage
path would run the same GEMV kernels, only with ~10 calls and parallel regions per layer): per layer
RMSNorm, QKV (+bias), q/k RMSNorm (Qwen3), RoPE (whole or partial heads), KV write, paged attention,
O + residual, RMSNorm, gate/up, SiLU*up, down + residual (a mixture-of-experts layer: the router,
the routing and the selected experts, cpu_moe.h), with no Python and no tensor allocation between
them. The four matrices of a
layer may be in any weight format the loaded kernels support (bf16 / fp32 tensors, or quantized
weight objects, see KERNELS.md), the qkv matrix also as two runs of rows in two block formats
(`split_desc`: a Q4_K_M file's Q4_K q and k rows and Q6_K v rows, each run its own row chunks);
norms, bias, activations and KV are in the model's dtype.

With `with_logits`, the same call also runs the final norm and the LM head (dp_decode_step_*), as the
last stages of the same parallel region, when the head would run in the kernels anyway
(`head_applies`): the same arithmetic as Transformer.logits through the kernels.
"""

from __future__ import annotations

import ctypes

import torch

from dualpace.model.cpu_kernels import MIXED_MAX_ROWS, Kernels, WeightDescC, run_descs, weight_desc
from dualpace.model.cpu_moe import MAX_TOP_K

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _LayerArgs(ctypes.Structure):
    """Mirrors LayerArgs in cpu_kernels.cpp."""

    _fields_ = [("H", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("input_norm", _ptr), ("qkv_b", _ptr),
                ("post_norm", _ptr), ("qkv_w", WeightDescC), ("o_w", WeightDescC), ("gate_up_w", WeightDescC),
                ("down_w", WeightDescC), ("k_cache", _ptr), ("v_cache", _ptr), ("num_blocks", _i64),
                ("block_size", _i64), ("q_norm", _ptr), ("k_norm", _ptr), ("rotary_dim", _i64),
                ("qkv_tail_w", WeightDescC), ("router_w", WeightDescC), ("moe", _ptr), ("top_k", _i64),
                ("norm_topk_prob", _i64)]


class _HeadArgs(ctypes.Structure):
    """Mirrors HeadArgs in cpu_kernels.cpp."""

    _fields_ = [("final_norm", _ptr), ("eps", _f32), ("lm_head", WeightDescC)]


class _StepArgs(ctypes.Structure):
    """Mirrors StepArgs in cpu_kernels.cpp."""

    _fields_ = [("M", _i64), ("cos", _ptr), ("sin", _ptr), ("slots", _ptr), ("tables", _ptr), ("ld_tables", _i64),
                ("lens", _ptr), ("scratch", _ptr)]


# head_dims with kernels (with_head_dim in cpu_attention.h): the avx512_bf16 variant's bf16
# attention takes a head row as 32-element pairs, every other path in 16-element vectors
HEAD_DIMS = (16, 32, 64, 128)
BF16_PAIRS_HEAD_DIMS = (32, 64, 128)


def fused_head_dims(dtype: torch.dtype, variant: str | None) -> tuple[int, ...]:
    return BF16_PAIRS_HEAD_DIMS if dtype == torch.bfloat16 and variant in (None, "avx512_bf16") else HEAD_DIMS


_VECTORS = ("input_norm", "post_attention_norm", "qkv_bias", "q_norm", "k_norm")


def _layer_matrices(layer) -> list:
    """The matrices a layer's step reads: a MoE layer's router and experts in place of the dense MLP."""
    attention = [layer.qkv_proj, layer.o_proj]
    if layer.moe is None:
        return attention + [layer.gate_up_proj, layer.down_proj]
    return attention + [layer.moe.router, *layer.moe.expert_gate_up, *layer.moe.expert_down]


def split_desc(weight) -> tuple[WeightDescC, WeightDescC] | None:
    """A matrix as the fused call takes it: (its descriptor, an empty one) when it has one layout;
    (first run, second run) when its rows are two runs of block formats (run_descs); else None."""
    desc = weight_desc(weight)
    if desc is not None:
        return desc, WeightDescC()
    runs = run_descs(weight)
    if runs is None or len(runs) != 2:
        return None
    (_, head), (_, tail) = runs
    return head, tail


class FusedDecode:
    """Built once per (model, KV storage); the weight and cache pointers are fixed at construction."""

    def __init__(self, kernels: Kernels, model, kv):
        cfg = model.config
        self.kernels = kernels
        self.dtype = model.dtype
        self._keep = (model.weights, kv.k, kv.v)  # the pointers below stay valid while these live
        self.num_layers = cfg.num_layers
        self.layers = (_LayerArgs * cfg.num_layers)()
        for i, layer in enumerate(model.weights.layers):
            (qkv, qkv_tail), o = split_desc(layer.qkv_proj), weight_desc(layer.o_proj)
            router, experts, top_k = WeightDescC(), None, 0
            if layer.moe is None:
                gate_up, down = weight_desc(layer.gate_up_proj), weight_desc(layer.down_proj)
            else:  # the routed experts in place of the dense MLP (cpu_moe.h)
                gate_up, down, router = WeightDescC(), WeightDescC(), weight_desc(layer.moe.router)
                experts, top_k = model.grouped_experts(i, kernels), cfg.moe.num_experts_per_tok
            self.layers[i] = _LayerArgs(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                cfg.rms_norm_eps, cfg.head_dim**-0.5, layer.input_norm.data_ptr(),
                None if layer.qkv_bias is None else layer.qkv_bias.data_ptr(), layer.post_attention_norm.data_ptr(),
                qkv, o, gate_up, down, kv.k[i].data_ptr(), kv.v[i].data_ptr(), kv.num_blocks, kv.block_size,
                *(None if t is None else t.data_ptr() for t in (layer.q_norm, layer.k_norm)), cfg.rotary_dim or 0,
                qkv_tail, router, None if experts is None else ctypes.addressof(experts.args), top_k,
                int(cfg.moe is not None and cfg.moe.norm_topk_prob))
            if experts is not None:
                self._keep += (experts,)  # the layer's descriptors point into it
        self.scratch_per_row = (cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size)
        self._fn = kernels.lib.dp_decode_layers_bf16 if self.dtype == torch.bfloat16 else kernels.lib.dp_decode_layers_f32
        same_dtype_dense = any(isinstance(m, torch.Tensor) and m.dtype == self.dtype
                               for layer in model.weights.layers for m in _layer_matrices(layer))
        self.max_rows = kernels.dense_max_rows(self.dtype) if same_dtype_dense else MIXED_MAX_ROWS
        self._lm_head = model.weights.lm_head
        final_norm, head = model.weights.final_norm, weight_desc(model.weights.lm_head)
        self._head = None
        if (head is not None and model.kernel_capable and kernels.supports_format(head.format)
                and final_norm.dtype == self.dtype and final_norm.is_contiguous() and head.K == cfg.hidden_size):
            self._head = _HeadArgs(final_norm.data_ptr(), cfg.rms_norm_eps, head)
        self._step_fn = kernels.lib.dp_decode_step_bf16 if self.dtype == torch.bfloat16 else kernels.lib.dp_decode_step_f32

    def head_applies(self, hidden: torch.Tensor) -> bool:
        """Whether run() can compute the logits of these rows: the LM head would run in the
        kernels for them (Kernels.linear's choice), so folding it changes no result."""
        return self._head is not None and self.kernels.linear_desc(hidden, self._lm_head) is not None

    @staticmethod
    def missing_features(config) -> list[str]:
        """The model's features the fused call does not compute (the per-stage path runs such a model)."""
        moe = config.moe
        return [name for name, present in (("sliding-window attention", config.sliding_window is not None),
                                           ("Gemma's sandwich norms and GELU-tanh gate", config.family.gemma),
                                           ("a shared expert", moe is not None and moe.shared_expert_intermediate_size > 0),
                                           (f"more than {MAX_TOP_K} experts a token",
                                            moe is not None and moe.num_experts_per_tok > MAX_TOP_K))
                if present]

    @staticmethod
    def applies(model, kv, kernels: Kernels | None = None) -> bool:
        """Whether the model's shapes, features, dtypes and (with `kernels`) weight formats fit the fused call."""
        cfg = model.config
        if FusedDecode.missing_features(cfg):
            return False
        head_dims = fused_head_dims(model.dtype, None if kernels is None else kernels.variant)
        if not (model.device.type == "cpu" and kv.device.type == "cpu" and model.dtype == kv.dtype
                and model.dtype in (torch.float32, torch.bfloat16) and cfg.head_dim in head_dims
                and cfg.num_heads // cfg.num_kv_heads <= 16):
            return False
        if kernels is None:
            return True
        for i, layer in enumerate(model.weights.layers):
            for name in _VECTORS:
                t = getattr(layer, name)
                if t is not None and (t.dtype != model.dtype or not t.is_contiguous()):
                    return False
            qkv = split_desc(layer.qkv_proj)
            descs = [*qkv, *(weight_desc(m) for m in _layer_matrices(layer)[1:])] if qkv else [None]
            if any(d is None or (d.N and not kernels.supports_format(d.format)) for d in descs):
                return False
            if layer.moe is not None and model.grouped_experts(i, kernels) is None:
                return False
        return True

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_ids: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, with_logits: bool = False) -> torch.Tensor | None:
        """Run every layer over hidden [M, H] (contiguous, updated in place); with `with_logits`
        (only where head_applies(hidden)), also the final norm and LM head: returns the logits
        [M, vocab] float32."""
        rows = hidden.shape[0]
        scratch = torch.empty(rows * self.scratch_per_row, dtype=self.dtype)
        step = _StepArgs(rows, cos.data_ptr(), sin.data_ptr(), slot_ids.data_ptr(), block_tables.data_ptr(),
                         block_tables.shape[1], context_lens.data_ptr(), scratch.data_ptr())
        logits = None
        if with_logits:
            if not self.head_applies(hidden):
                raise ValueError("decode step: the LM head does not run in the fused kernels for these rows")
            logits = torch.empty((rows, self._head.lm_head.N), dtype=torch.float32)
            status = self._step_fn(hidden.data_ptr(), self.layers, self.num_layers, ctypes.byref(step),
                                   ctypes.byref(self._head), logits.data_ptr())
        else:
            status = self._fn(hidden.data_ptr(), self.layers, self.num_layers, ctypes.byref(step))
        if status == -2:
            raise IndexError("decode step: a slot id, context length or block id is out of range")
        if status != 0:
            raise ValueError("decode step: shape or weight format not supported by the fused kernels")
        return logits
