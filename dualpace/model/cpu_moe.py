"""A mixture-of-experts layer on the CPU kernels: the routing and the routed experts of a step.

The router product runs on the kernels (Kernels.linear), the softmax and top k in native code
(route_on_kernels: dualpace.model.moe.route's arithmetic, in the same code as the one-call decode
step's MoE layers, cpu_fused_decode.py, so that a row gets bitwise the same routing either way); the
selected experts' gate/up, SiLU * up, down and the weighted sum run in one kernel call
(dp_moe_experts_* in cpu_moe.h): one parallel region over every selected expert's chunks of weight
rows, so two threads stay busy when each expert has one row. An expert's products are those
Kernels.linear would compute for its rows, so the call applies while every expert's number of rows
is one the kernels take for its matrices (`max_rows_per_expert`: a prefill-sized expert goes to
the per-expert path, where its matrices may go to torch's GEMM). In a step that mixes prefill and
decode rows, the decode rows (kernel_rows) get the grouped call's outputs, as they would alone.
"""

from __future__ import annotations

import ctypes

import torch

from dualpace.model.cpu_kernels import MIXED_MAX_ROWS, Kernels, WeightDescC, weight_desc
from dualpace.model.moe import MoeWeights, add_shared_expert, route, routed_experts
from dualpace.model.moe_spec import MoeSpec

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
MAX_TOP_K = 64  # choices per row the native routing takes (MOE_MAX_TOP_K in cpu_moe.h)


class _MoeExpertsArgs(ctypes.Structure):
    """Mirrors MoeExpertsArgs in cpu_moe.h."""

    _fields_ = [("num_experts", _i64), ("hidden", _i64), ("intermediate", _i64), ("gate_up", _ptr), ("down", _ptr)]


class GroupedExperts:
    """One layer's expert matrices as the kernels see them (descriptors built once)."""

    def __init__(self, kernels: Kernels, weights: MoeWeights, gate_up: list[WeightDescC], down: list[WeightDescC]):
        self.kernels = kernels
        self._weights = weights  # the descriptors point into these matrices
        self._gate_up = (WeightDescC * len(gate_up))(*gate_up)
        self._down = (WeightDescC * len(down))(*down)
        self.args = _MoeExpertsArgs(len(gate_up), gate_up[0].K, down[0].K, ctypes.addressof(self._gate_up),
                                     ctypes.addressof(self._down))

    @classmethod
    def build(cls, kernels: Kernels, weights: MoeWeights) -> GroupedExperts | None:
        """The layer's experts for the grouped call; None where a matrix has no kernel layout or its
        format no kernel here."""
        gate_up = [weight_desc(m) for m in weights.expert_gate_up]
        down = [weight_desc(m) for m in weights.expert_down]
        if any(d is None or not kernels.supports_format(d.format) for d in gate_up + down):
            return None
        return cls(kernels, weights, gate_up, down)

    def max_rows_per_expert(self, dtype: torch.dtype) -> int:
        """Most rows of x one expert may have for the grouped call: Kernels.linear's limits for its
        matrices (the first expert's stand for all)."""
        def limit(m) -> int:
            if isinstance(m, torch.Tensor):
                return self.kernels.dense_max_rows(dtype) if m.dtype == dtype else MIXED_MAX_ROWS
            return m.dense_min_rows - 1

        return min(limit(self._weights.expert_gate_up[0]), limit(self._weights.expert_down[0]))

    def applies(self, x: torch.Tensor, top_ids: torch.Tensor, num_experts: int) -> bool:
        if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.shape[0] == 0:
            return False
        busiest = int(torch.bincount(top_ids.reshape(-1), minlength=num_experts).max())
        return busiest <= self.max_rows_per_expert(x.dtype)

    def run(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """sum over each row's choices of weight * expert(x) -> [rows, hidden] in x's dtype."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        ids = top_ids.to(torch.int64).contiguous()
        weights = top_weights.to(x.dtype).contiguous()
        out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype)
        lib = self.kernels.lib
        fn = lib.dp_moe_experts_bf16 if x.dtype == torch.bfloat16 else lib.dp_moe_experts_f32
        status = fn(x.data_ptr(), x.shape[0], x.stride(0), ids.data_ptr(), weights.data_ptr(), ids.shape[1],
                    ctypes.byref(self.args), out.data_ptr())
        if status == -2:
            raise IndexError(f"MoE experts: an expert id is outside [0, {self.args.num_experts})")
        if status != 0:
            raise ValueError("MoE experts: shapes or weight formats the grouped kernel does not run")
        return out


def _kernel_matmul(kernels: Kernels):
    """dualpace.model.moe's Matmul on the kernels."""
    def matmul(rows: torch.Tensor, weight, rows_for_kernels: torch.Tensor | None) -> torch.Tensor:
        return kernels.linear(rows, weight, kernel_rows=rows_for_kernels)

    return matmul


def route_on_kernels(x: torch.Tensor, router, spec: MoeSpec, kernels: Kernels,
                     kernel_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dualpace.model.moe.route with the router product on the kernels and the softmax, top k and
    normalisation in native code (dp_moe_route_*): (weights [T, k] in x's dtype, expert ids [T, k]).
    More than MAX_TOP_K choices a row: torch's route."""
    matmul = _kernel_matmul(kernels)
    k = spec.num_experts_per_tok
    if k > MAX_TOP_K:
        return route(x, router, spec, matmul, kernel_rows)
    logits = matmul(x, router, kernel_rows).contiguous()
    ids = torch.empty((x.shape[0], k), dtype=torch.int64)
    weights = torch.empty((x.shape[0], k), dtype=logits.dtype)
    fn = kernels.lib.dp_moe_route_bf16 if logits.dtype == torch.bfloat16 else kernels.lib.dp_moe_route_f32
    if fn(logits.data_ptr(), logits.shape[0], logits.shape[1], k, int(spec.norm_topk_prob), ids.data_ptr(),
          weights.data_ptr()) != 0:
        raise ValueError(f"MoE routing: top {k} of {logits.shape[1]} router outputs")
    return weights, ids


def moe_mlp_on_kernels(x: torch.Tensor, weights: MoeWeights, spec: MoeSpec, kernels: Kernels,
                       grouped: GroupedExperts | None, kernel_rows: torch.Tensor | None = None) -> torch.Tensor:
    """dualpace.model.moe.moe_mlp with every product on the kernels (Kernels.linear), the routed
    experts of the decode rows in one grouped call where it applies (the module's docstring)."""
    matmul = _kernel_matmul(kernels)
    top_weights, top_ids = route_on_kernels(x, weights.router, spec, kernels, kernel_rows)
    every_row = kernel_rows is None or kernel_rows.numel() == x.shape[0]  # kernel_rows: distinct row indices
    if grouped is not None and every_row and grouped.applies(x, top_ids, spec.num_experts):
        out = grouped.run(x, top_ids, top_weights)
    elif grouped is not None and not every_row and kernel_rows.numel() > 0 and grouped.applies(
            x[kernel_rows], top_ids[kernel_rows], spec.num_experts):
        out = routed_experts(x, weights, spec, top_weights, top_ids, matmul, None, kernels.silu_mul)
        out.index_copy_(0, kernel_rows, grouped.run(x[kernel_rows], top_ids[kernel_rows], top_weights[kernel_rows]))
    else:
        out = routed_experts(x, weights, spec, top_weights, top_ids, matmul, kernel_rows, kernels.silu_mul)
    return add_shared_expert(out, x, weights, matmul, kernel_rows, kernels.silu_mul)
