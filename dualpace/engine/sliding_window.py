"""KV accounting under a sliding window. Pure: no torch, grpc, asyncio or clock reads; the scheduler
owns one when built with a window, over the pool of the layers that slide: the one pool when every
layer slides (Mistral-SWA, Phi-3 with a window), or the sliding layers' own pool in a model that mixes
them with global layers (Gemma 3: the global layers' pool keeps every block; `split_kv_blocks` sizes
the two pools).

Once a request's next query at position p sees only p - window + 1 .. p, its blocks wholly before that
are returned to the pool (KVBlockManager.release_leading_blocks), after each step, on admission and on
import; it is admitted on its first chunk's blocks and appends the rest chunk by chunk, so a request
longer than the pool runs.

Prefix reuse under a window (PrefixCache): a cached prefix of k blocks serves when the blocks the next
query's window reaches (those from position k * block_size - window + 1 on) are all still in the pool,
held or cached; the blocks before them need not be (evicted ones included): the new table starts
released there.
"""

from __future__ import annotations

from dualpace.engine.request import EngineRequest
from dualpace.kv.block_table import KVBlockManager


def split_kv_blocks(num_blocks: int, num_layers: int, num_window_layers: int, window_tokens: int, block_size: int,
                    max_running: int, max_batch_tokens: int) -> tuple[int, int]:
    """(global layers' blocks, sliding layers' blocks) for a model whose `num_window_layers` of
    `num_layers` layers slide, from a budget of `num_blocks` blocks of every layer (same bytes). The
    sliding pool gets what the running sequences can hold at once under the window (each its window and
    a decode token, plus a block for alignment; the step's tokens on top), never more than the global
    pool; the bytes it leaves go to the global pool."""
    if not 0 < num_window_layers < num_layers:
        raise ValueError(f"{num_window_layers} sliding layers of {num_layers}: no two layer groups to split")
    per_sequence = -(-window_tokens // block_size) + 1
    num_window_blocks = min(num_blocks, max_running * per_sequence + -(-max_batch_tokens // block_size))
    num_global_layers = num_layers - num_window_layers
    num_global_blocks = num_blocks + num_window_layers * (num_blocks - num_window_blocks) // num_global_layers
    return num_global_blocks, num_window_blocks


class SlidingWindowBlocks:
    def __init__(self, window_tokens: int, blocks: KVBlockManager):
        if window_tokens < 1:
            raise ValueError(f"sliding_window_tokens must be >= 1, got {window_tokens}")
        self.window_tokens = window_tokens
        self.blocks = blocks
        self.num_released_blocks = 0  # blocks returned to the pool by the window

    def num_blocks_held_at_most(self, max_batch_tokens: int) -> int:
        """A window and a step's tokens, plus a block each way for alignment."""
        return self.blocks.num_blocks_for(self.window_tokens - 1 + max_batch_tokens) + 1

    def num_tokens_to_reserve(self, request: EngineRequest, num_cached_blocks: int, budget: int) -> int:
        """Token slots taken on admission: up to the first chunk's end; later chunks append, as decodes
        do, while the window releases."""
        return min(request.num_tokens, num_cached_blocks * self.blocks.block_size + budget)

    def release_outside(self, request: EngineRequest) -> None:
        """Return the blocks wholly before the next query's window to the pool."""
        first_visible_pos = request.num_computed_tokens - self.window_tokens + 1
        if first_visible_pos >= self.blocks.block_size:
            self.num_released_blocks += self.blocks.release_leading_blocks(
                request.request_id, first_visible_pos // self.blocks.block_size)
