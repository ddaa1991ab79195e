"""KV accounting under a sliding window that every layer of the model has (Mistral-SWA, Phi-3 with a
window). Pure: no torch, grpc, asyncio or clock reads; the scheduler owns one when built with a window.

Once a request's next query at position p sees only p - window + 1 .. p, its blocks wholly before that
are returned to the pool (KVBlockManager.release_leading_blocks), after each step, on admission and on
import; it is admitted on its first chunk's blocks and appends the rest chunk by chunk, so a request
longer than the pool runs. Only a model whose layers all slide frees this way: a global layer (Gemma 3)
needs the whole context.

Prefix reuse under a window (PrefixCache): a cached prefix of k blocks serves when the blocks the next
query's window reaches (those from position k * block_size - window + 1 on) are all still in the pool,
held or cached; the blocks before them need not be (evicted ones included): the new table starts
released there.
"""

from __future__ import annotations

from dualpace.engine.request import EngineRequest
from dualpace.kv.block_table import KVBlockManager


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
