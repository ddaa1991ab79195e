"""Executes a StepPlan on a device: one paged forward pass, then sampling."""

from __future__ import annotations

import torch

from dualpace.engine.scheduler import StepPlan, StepResult
from dualpace.kv.storage import KVStorage
from dualpace.model.loader import LoadedModel
from dualpace.model.paged_forward import PagedForward, SequenceWork
from dualpace.sampling import sample_next_tokens


class ModelRunner:
    """Owns the device KV storage and runs the model over it."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int):
        cfg = loaded.config
        model = loaded.model
        self.loaded = loaded
        self.kv = KVStorage(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                            model.dtype, model.device)
        self.forward = PagedForward(model, self.kv)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        if plan.is_empty:
            return StepResult({})
        work = [SequenceWork(list(s.token_ids), s.start_pos, list(s.block_ids)) for s in plan.sequences]
        logits = self.forward.forward(work)
        rows = [i for i, s in enumerate(plan.sequences) if s.sample]
        if not rows:
            return StepResult({})
        sampled = [plan.sequences[i] for i in rows]
        result = sample_next_tokens(
            logits[rows], [s.params for s in sampled], [s.seed for s in sampled], [s.sample_position for s in sampled]
        )
        return StepResult({
            s.request_id: (token_id if finite else None)
            for s, token_id, finite in zip(sampled, result.token_ids, result.finite)
        })

    # KV transfer: a request's cache as contiguous per-layer tensors, and back.

    def read_kv(self, slot_ids: list[int], layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_tokens, kv_heads, head_dim] of the given flat slots, on the CPU."""
        index = torch.tensor(slot_ids, dtype=torch.long, device=self.kv.device)
        flat_shape = (-1, self.kv.num_kv_heads, self.kv.head_dim)
        k = self.kv.k[layer_index].view(flat_shape).index_select(0, index)
        v = self.kv.v[layer_index].view(flat_shape).index_select(0, index)
        return k.cpu(), v.cpu()

    def write_kv(self, slot_ids: list[int], layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(slot_ids, dtype=torch.long, device=self.kv.device)
        self.kv.write(layer_index, index, k.to(self.kv.device), v.to(self.kv.device))
