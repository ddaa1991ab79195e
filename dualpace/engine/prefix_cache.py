"""The scheduler's side of the prefix cache: look a request up on admission, register the
blocks it fills, count hits, publish KV events. Pure: no torch, grpc, asyncio or clock.

A request keeps the chain of its full blocks' hashes (``block_hashes``), extended as its
tokens grow; its tokens never change, so a preempted or migrated request reuses the chain.

With a pool of the sliding layers' own (Gemma 3; Scheduler.pools), a block is cached in each pool,
and a prefix serves when both can supply it: the global layers' pool every block of it, the sliding
pool the blocks the next query's window reaches (as when every layer slides). KV events and the
host tier follow the first pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from dualpace.engine.request import EngineRequest
from dualpace.kv.block_table import KVBlockManager
from dualpace.kv.events import KvEventLog
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.logprobs import wants_prompt_logprobs


class PrefixCache:
    def __init__(self, pools: list[KVBlockManager], hasher: BlockHasher, events: KvEventLog | None = None,
                 sliding_window_tokens: int | None = None):
        """pools: the scheduler's (one, or the global layers' then the sliding layers' own); the
        window slides over the last."""
        blocks = pools[0]
        if hasher.block_size != blocks.block_size:
            raise ValueError(f"block hasher's block size {hasher.block_size} != {blocks.block_size}")
        self.pools = pools
        self.blocks = blocks
        self.hasher = hasher
        self.events = events  # stored / removed events, for WatchKvEvents
        # the last pool's layers slide: match there only what the window needs
        self.sliding_window_tokens = sliding_window_tokens
        if events is not None:
            blocks.set_forget_listener(events.removed)
        self.num_query_tokens = 0  # tokens of admitted requests looked up
        self.num_hit_tokens = 0  # of those, tokens whose KV the cache held

    def match(self, request: EngineRequest) -> list[list[int]]:
        """Per pool, the cached blocks holding the request's leading tokens, all but its last token at
        most (so the first sampled token's logits are computed, and no shared block is written); in the
        pool the window slides over, leading blocks no window reaches are FREED_BLOCK_ID entries and
        need not be cached (KVBlockManager.match_prefix_in_window). Every pool's list covers the same
        tokens. None for a request that still needs its prompt's log-probabilities: every prompt token
        is computed."""
        self.hasher.extend(request.block_hashes, request.token_ids(0, request.num_tokens))
        if wants_prompt_logprobs(request.params, request.output_token_ids):
            return [[] for _ in self.pools]
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.blocks.block_size]
        window = self.sliding_window_tokens
        if len(self.pools) == 1:
            return [self.blocks.match_prefix(hashes) if window is None else
                    self.blocks.match_prefix_in_window(hashes, window)]
        global_blocks = self.blocks.match_prefix(hashes)
        window_blocks = self.pools[1].match_prefix_in_window(hashes[:len(global_blocks)], window)
        return [global_blocks[:len(window_blocks)], window_blocks]

    def count_lookup(self, request: EngineRequest, num_hit_tokens: int) -> None:
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens

    def reset_counts(self) -> None:
        self.num_query_tokens = self.num_hit_tokens = 0

    def cache_full_blocks(self, request: EngineRequest) -> None:
        """Register the request's blocks whose KV is now computed in full."""
        num_full_blocks = request.num_computed_tokens // self.blocks.block_size
        if num_full_blocks > len(request.block_hashes):
            self.hasher.extend(request.block_hashes, request.token_ids(0, request.num_computed_tokens))
        registered = self.blocks.register_full_blocks(request.request_id, request.block_hashes, num_full_blocks)
        for pool in self.pools[1:]:
            pool.register_full_blocks(request.request_id, request.block_hashes, num_full_blocks)
        if self.events is not None and registered:
            self._publish_stored(request.block_hashes, request.token_ids(0, num_full_blocks * self.blocks.block_size),
                                 registered)

    def store_blocks(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Register the full blocks of ``seq_id`` (a table holding exactly ``token_ids``, its KV
        written: a host-tier import, into the one pool of an engine without a sliding pool of its
        own) in the cache; how many entered it (not those it held already)."""
        block_hashes = self.hasher.chain(token_ids)
        registered = self.blocks.register_full_blocks(seq_id, block_hashes, len(block_hashes))
        if self.events is not None and registered:
            self._publish_stored(block_hashes, token_ids, registered)
        return len(registered)

    def _publish_stored(self, hashes: Sequence[bytes], token_ids: Sequence[int], indexes: list[int]) -> None:
        """One stored event per run of consecutive newly cached blocks (token_ids: from the first block)."""
        size = self.blocks.block_size
        start = 0
        for end in range(1, len(indexes) + 1):
            if end == len(indexes) or indexes[end] != indexes[end - 1] + 1:
                first, last = indexes[start], indexes[end - 1]
                self.events.stored(hashes[first:last + 1], hashes[first - 1] if first else None,
                                   token_ids[first * size:(last + 1) * size])
                start = end
