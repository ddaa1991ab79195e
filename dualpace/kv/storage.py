"""KV cache tensors on one device, addressed by block id and flat slot id.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and V.
A token at position p of a sequence with block table `block_ids` lives in slot
block_ids[p // block_size] * block_size + p % block_size. The bookkeeping of
which blocks belong to whom is pure Python (dualpace.kv.allocator); this class
only holds the tensors.

A model mixing sliding-window and global layers (Gemma 3) may give its sliding layers a pool of
their own (`window_layers`, `num_window_blocks`): those layers then hold num_window_blocks blocks
each, addressed by the sliding pool's block ids, the others num_blocks. `k` and `v` are then lists
of per-layer tensors rather than one [num_layers, ...] tensor, and the pool is not shared memory.
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
        window_layers: tuple[bool, ...] | None = None,
        num_window_blocks: int = 0,
    ):
        """`memory`, for a CPU pool: allocates K and V elsewhere than in private memory (e.g.
        dualpace.engine.transfer.shm_segment.SharedKvMemory, so engines on this host can write into it).
        `window_layers` with `num_window_blocks` > 0: the layers marked True get the sliding pool."""
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_window_blocks = num_window_blocks if window_layers is not None else 0
        if self.num_window_blocks:
            if len(window_layers) != num_layers:
                raise ValueError(f"window_layers names {len(window_layers)} layers, the storage has {num_layers}")
            self.k, self.v = self._layer_pools(window_layers)
        elif memory is not None and self.device.type == "cpu":
            self.k, self.v = memory.allocate((num_layers, num_blocks, block_size, num_kv_heads, head_dim), dtype)
        else:
            shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def _layer_pools(self, window_layers: tuple[bool, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V: views into one tensor per pool (sliding layers, global layers)."""
        num_sliding = sum(window_layers)
        tail = (self.block_size, self.num_kv_heads, self.head_dim)
        pools = {}
        for sliding, num_layers, num_blocks in ((True, num_sliding, self.num_window_blocks),
                                                (False, self.num_layers - num_sliding, self.num_blocks)):
            pools[sliding] = [torch.zeros((num_layers, num_blocks, *tail), dtype=self.dtype, device=self.device)
                              for _ in "kv"]
        taken = {True: 0, False: 0}
        k, v = [], []
        for sliding in window_layers:
            k.append(pools[sliding][0][taken[sliding]])
            v.append(pools[sliding][1][taken[sliding]])
            taken[sliding] += 1
        return k, v

    @property
    def has_window_pool(self) -> bool:
        """Whether the sliding layers hold a pool of their own (then slots differ per layer group)."""
        return self.num_window_blocks > 0

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V, all layers, for one block (of a storage without a sliding pool)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.k.element_size()

    def write(self, layer_index: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [num_tokens, num_kv_heads, head_dim] at flat slots [num_tokens]."""
        kernels = cpu_kernels.usable_for(self.k[layer_index]) if k.device == self.device else None
        if kernels is not None and kernels.kv_write(self.k[layer_index], self.v[layer_index], slot_ids, k, v):
            return
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        self.k[layer_index].view(flat_shape).index_copy_(0, slot_ids, k.to(self.dtype))
        self.v[layer_index].view(flat_shape).index_copy_(0, slot_ids, v.to(self.dtype))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer, e.g. for copy-on-write (a storage without a
        sliding pool: block ids are one pool's)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
