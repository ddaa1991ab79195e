"""The scheduler's KV accounting over its block pools: what a request must fit, what admission
reserves in each pool, the blocks each step appends (preempting when a pool runs out), the window's
releases, and freeing. Pure, as the scheduler is; mixed into Scheduler.

Pools (Scheduler.pools): one, or, for a model mixing sliding and global layers, the global layers'
pool then the sliding layers' own. A request holds a table in each; the pool the window slides over
(SlidingWindowBlocks.blocks) reserves a request's first chunk on admission and releases what the
window has passed, any other pool reserves the whole request.
"""

from __future__ import annotations

from dualpace.engine.request import EngineRequest
from dualpace.errors import InvalidArgument
from dualpace.kv.block_table import KVBlockManager


class PoolReservations:
    """Reads the Scheduler's pools, blocks, window, running list and config."""

    def _admission_reservations(self, request: EngineRequest, cached_block_ids: list[list[int]],
                                budget: int) -> list[tuple[KVBlockManager, int, list[int]]]:
        """(pool, tokens to reserve, its cached leading blocks) for admitting `request`, in every pool
        (cached_block_ids: per pool, PrefixCache.match)."""
        return [(pool, self._num_tokens_to_reserve(pool, request, cached, budget), cached)
                for pool, cached in zip(self.pools, cached_block_ids)]

    def _check_fits(self, request: EngineRequest) -> None:
        """A request must fit each pool alone at its longest (prompt + max_tokens, less the last token);
        in the pool the window slides over, at most a window and a step's tokens of it are held at once
        (plus a block each way for alignment)."""
        needed = self.blocks.num_blocks_for(len(request.prompt_token_ids) - 1 + request.params.max_tokens)
        for pool in self.pools:
            needed_here = needed
            if self.window is not None and self.window.blocks is pool:
                needed_here = min(needed, self.window.num_blocks_held_at_most(self.config.max_batch_tokens))
            if needed_here > pool.num_total_blocks:
                raise InvalidArgument("max_tokens", f"prompt + max_tokens needs {needed_here} KV blocks; "
                                                    f"this engine has {pool.num_total_blocks}")

    def _num_tokens_to_reserve(self, pool: KVBlockManager, request: EngineRequest, cached_block_ids: list[int],
                               budget: int) -> int:
        if self.window is None or self.window.blocks is not pool:
            return request.num_tokens
        return self.window.num_tokens_to_reserve(request, len(cached_block_ids), budget)

    def _can_admit(self, pool: KVBlockManager, num_reserved_tokens: int, cached_block_ids: list[int]) -> bool:
        """Admit while KV suffices, keeping a small reserve for the running decodes'
        next blocks (no reserve when nothing runs, so a request that fits alone runs)."""
        needed = pool.num_blocks_to_take(num_reserved_tokens, cached_block_ids)
        reserve = min(len(self.running), max(1, pool.num_total_blocks // 100)) if self.running else 0
        return pool.num_available_blocks >= needed + reserve

    def _release_outside_window(self, request: EngineRequest) -> None:
        if self.window is not None:
            self.window.release_outside(request)

    def _reserve_kv(self, request: EngineRequest, num_new: int, preempted: list[str]) -> bool:
        """Make room for the request's next `num_new` tokens in every pool, preempting the newest
        running requests if needed. False when the request itself was preempted."""
        end = request.num_computed_tokens + num_new
        request_id = request.request_id
        while not all(pool.can_append(request_id, max(0, end - pool.num_tokens(request_id))) for pool in self.pools):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        for pool in self.pools:
            if end > pool.num_tokens(request_id):
                pool.append(request_id, end - pool.num_tokens(request_id))
        return True

    def _free_blocks(self, request_id: str) -> None:
        """Return the request's blocks in every pool (it may hold none)."""
        for pool in self.pools:
            if pool.has(request_id):
                pool.free(request_id)
