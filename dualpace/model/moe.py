"""The mixture-of-experts MLP of one layer (routing rules: dualpace.model.moe_spec).

The rows of a step are grouped by routed expert: one sort of the (row, choice) pairs by expert id,
then each selected expert runs once over all of its rows (gate/up, SiLU * up, down), its outputs
scaled by the rows' routing weights and added into the result in ascending expert order, the
order of transformers' own loop. Unselected experts are never touched, so a step reads the
weights of the experts its rows chose, not all of them. The same code runs on a GPU (one
device-to-host copy of the per-expert counts per layer) and on the CPU, where the products go to
the CPU kernels (`matmul` below) and an expert's matrices may stay in their GGUF blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dualpace.model.moe_spec import MoeSpec

# matmul(x [M, K], weight [N, K], kernel_rows) -> [M, N]: the caller's product (torch, or the CPU
# kernels with `kernel_rows` of x that must get the kernels' product, for batch invariance)
Matmul = Callable[[torch.Tensor, object, "torch.Tensor | None"], torch.Tensor]


@dataclass
class MoeWeights:
    """One sparse layer. Each expert's gate and up are fused into one matrix, as in LayerWeights."""

    router: torch.Tensor  # [num_experts, hidden]
    expert_gate_up: list  # num_experts matrices [2 * expert_intermediate, hidden]
    expert_down: list  # num_experts matrices [hidden, expert_intermediate]
    shared_gate_up: object | None = None  # [2 * shared_intermediate, hidden]
    shared_down: object | None = None  # [hidden, shared_intermediate]
    shared_gate: torch.Tensor | None = None  # [1, hidden] (sigmoid gate of the shared expert)

    def matrices(self) -> list:
        """Every matrix the layer holds (for byte counts, formats and moving)."""
        shared = [m for m in (self.shared_gate_up, self.shared_down, self.shared_gate) if m is not None]
        return [self.router, *self.expert_gate_up, *self.expert_down, *shared]

    def map_matrices(self, fn: Callable, routing_fn: Callable | None = None) -> MoeWeights:
        """A copy with fn applied to every expert matrix (moving, casting or quantizing) and
        routing_fn (default fn) to the router and the shared expert's gate, which decide the routing."""
        routing_fn = routing_fn or fn

        def opt(m, f):
            return None if m is None else f(m)

        return MoeWeights(routing_fn(self.router), [fn(m) for m in self.expert_gate_up],
                          [fn(m) for m in self.expert_down], opt(self.shared_gate_up, fn), opt(self.shared_down, fn),
                          opt(self.shared_gate, routing_fn))


def route(x: torch.Tensor, router: torch.Tensor, spec: MoeSpec, matmul: Matmul,
          kernel_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, expert ids [T, k]): softmax in float32 over all experts, top k,
    renormalised when spec.norm_topk_prob."""
    probs = torch.softmax(matmul(x, router, kernel_rows).float(), dim=-1)
    top_weights, top_ids = torch.topk(probs, spec.num_experts_per_tok, dim=-1)
    if spec.norm_topk_prob:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return top_weights.to(x.dtype), top_ids


def swiglu(x: torch.Tensor, gate_up, down, matmul: Matmul, kernel_rows: torch.Tensor | None,
           silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """down(SiLU(gate x) * up x) with gate and up fused into one matrix."""
    h = matmul(x, gate_up, kernel_rows)
    if silu_mul is not None:
        h = silu_mul(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    return matmul(h, down, kernel_rows)


def moe_mlp(x: torch.Tensor, weights: MoeWeights, spec: MoeSpec, matmul: Matmul,
            kernel_rows: torch.Tensor | None = None,
            silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE MLP over x [T, hidden] (already normed) -> [T, hidden], without the residual.
    kernel_rows: rows of x handed on to matmul, translated to each expert's own rows."""
    top_weights, top_ids = route(x, weights.router, spec, matmul, kernel_rows)
    out = routed_experts(x, weights, spec, top_weights, top_ids, matmul, kernel_rows, silu_mul)
    return add_shared_expert(out, x, weights, matmul, kernel_rows, silu_mul)


def routed_experts(x: torch.Tensor, weights: MoeWeights, spec: MoeSpec, top_weights: torch.Tensor,
                   top_ids: torch.Tensor, matmul: Matmul, kernel_rows: torch.Tensor | None = None,
                   silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The weighted sum of each row's routed experts (route's weights and ids), each selected
    expert run once over its rows."""
    num_rows, k = x.shape[0], spec.num_experts_per_tok
    flat_ids = top_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (row, choice) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=spec.num_experts).tolist()
    flat_weights = top_weights.reshape(-1)
    is_kernel_row = None
    if kernel_rows is not None:
        is_kernel_row = torch.zeros(num_rows, dtype=torch.bool, device=x.device)
        is_kernel_row[kernel_rows] = True
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        rows = pairs // k
        expert_rows = None if is_kernel_row is None else is_kernel_row[rows].nonzero().view(-1)
        y = swiglu(x[rows], weights.expert_gate_up[expert], weights.expert_down[expert], matmul, expert_rows, silu_mul)
        out.index_add_(0, rows, y * flat_weights[pairs, None])
    return out


def add_shared_expert(out: torch.Tensor, x: torch.Tensor, weights: MoeWeights, matmul: Matmul,
                      kernel_rows: torch.Tensor | None = None,
                      silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """out plus the shared expert's output over x (its sigmoid gate applied), where the layer has one."""
    if weights.shared_gate_up is None:
        return out
    shared = swiglu(x, weights.shared_gate_up, weights.shared_down, matmul, kernel_rows, silu_mul)
    if weights.shared_gate is not None:
        shared = torch.sigmoid(matmul(x, weights.shared_gate, kernel_rows)) * shared
    return out + shared
