"""KV cache tensors on one device, addressed by block id and flat slot id.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and V.
A token at position p of a sequence with block table `block_ids` lives in slot
block_ids[p // block_size] * block_size + p % block_size. The bookkeeping of
which blocks belong to whom is pure Python (dualpace.kv.allocator); this class
only holds the tensors.
"""

from __future__ import annotations

import torch

from dualpace.model import cpu_kernels


class KVStorage:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        memory=None,
    ):
        """`memory`, for a CPU pool: allocates K and V elsewhere than in private memory (e.g.
        dualpace.engine.transfer.shm_segment.SharedKvMemory, so engines on this host can write into it)."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        if memory is not None and self.device.type == "cpu":
            self.k, self.v = memory.allocate(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V, all layers, for one block."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.k.element_size()

    def write(self, layer_index: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [num_tokens, num_kv_heads, head_dim] at flat slots [num_tokens]."""
        kernels = cpu_kernels.usable_for(self.k) if k.device == self.device else None
        if kernels is not None and kernels.kv_write(self.k[layer_index], self.v[layer_index], slot_ids, k, v):
            return
        flat_shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k[layer_index].view(flat_shape).index_copy_(0, slot_ids, k.to(self.dtype))
        self.v[layer_index].view(flat_shape).index_copy_(0, slot_ids, v.to(self.dtype))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer, e.g. for copy-on-write."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
