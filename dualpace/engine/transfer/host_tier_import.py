"""Host tier, target side: a cache-only KV import (dualpace.engine.transfer.host_tier) lands in this
engine's prefix cache instead of becoming a live request.

The KV lands and is verified exactly as a migration's (KvImporter's reservation, the data
socket's receive and layer checksums); on commit the blocks are registered in this engine's
cache under this engine's own hashes (so the block size may differ from the source's: only full
blocks here are kept) and left unreferenced, so they are evicted LRU like any cached block and
never cost a request its room. The KV events of this engine then announce them (medium cpu),
which is how the router learns that a prefix lives in the host tier.

Only KV computed under this engine's prefix-cache salt is taken (model, weights as held,
compute dtype): blocks made with other weights or another dtype would not give the outputs
a recompute here gives, so they are refused (FAILED_PRECONDITION), naming both salts.

With ``skip_cached`` in the header, the leading blocks this engine caches already (same chain
hashes) are looked up at the header, shared by the import's table (so no step evicts them
before the commit) and reported back (``num_held_tokens``); the sender then sends only the
KV after them, and the commit registers the whole chain.
"""

from __future__ import annotations

import logging

from dualpace.engine.transfer.kv_transfer import ImportProgress, KvTransferHeader
from dualpace.engine.transfer.migration import KvImporter, engine_kv_layout
from dualpace.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)


class HostTierImporter(KvImporter):
    """One incoming cache-only transfer; the prepare step is KvImporter's."""

    num_new_blocks = 0  # blocks this import added to the cache (not those it held already)

    async def begin(self, header: KvTransferHeader) -> None:
        core = self.loop.core
        prefix_cache = core.scheduler.prefix_cache
        if prefix_cache is None:
            raise FailedPrecondition("this engine runs with --prefix-caching off: it keeps no host tier")
        if not core.moves_kv:
            raise FailedPrecondition("this model's sliding layers hold a KV pool of their own, which no transfer "
                                     "carries: this engine keeps no host tier")
        if header.cache_salt != prefix_cache.hasher.salt:
            raise FailedPrecondition(f"host-tier blocks made under {header.cache_salt!r}; this engine's prefix "
                                     f"cache is {prefix_cache.hasher.salt!r} (same model, weights and dtype needed)")
        own = engine_kv_layout(self.loop)
        layout = header.layout
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) != (
                own.num_layers, own.num_kv_heads, own.head_dim, own.dtype):
            raise InvalidArgument("header.layout", f"KV layout {layout} does not match this engine's {own}")
        num_tokens = len(header.prompt_token_ids)
        if header.output_token_ids or header.num_computed_tokens != num_tokens or num_tokens == 0:
            raise InvalidArgument("header.num_computed_tokens",
                                  "a cache-only import carries the KV of all its prompt tokens and no output")
        if num_tokens > core.loaded.max_context_tokens or max(header.prompt_token_ids) >= core.loaded.config.vocab_size:
            raise InvalidArgument("header.prompt_token_ids", "more tokens than the model's context, or an id "
                                                             "outside its vocabulary")

        def reserve() -> tuple[tuple[int, int], ...]:
            self.loop.check_accepting()
            held: list[int] = []
            if header.skip_cached:  # the leading blocks cached here already: shared (pinned), not sent
                held = core.scheduler.blocks.match_prefix(prefix_cache.hasher.chain(header.prompt_token_ids))
            core.scheduler.reserve_import(header.request_id, num_tokens, held)  # Overloaded when the pool is short
            self._reserved = True
            self.progress = ImportProgress(header)
            if header.skip_cached:
                self.progress.skip_held(len(held) * core.scheduler.blocks.block_size)
            return core.scheduler.blocks.slot_runs(header.request_id, 0, num_tokens)

        self._slot_runs = await self.loop.call(reserve)

    @property
    def num_held_tokens(self) -> int:
        """Leading tokens of the transfer this engine caches already (after begin; 0 without skip_cached)."""
        return 0 if self.progress is None else self.progress.first_token

    async def commit(self, wake_loop: bool = True) -> str:
        """Register the blocks in this engine's cache (unreferenced); returns this engine's name.
        wake_loop as KvImporter.commit's."""
        progress = await self.prepare()
        header = progress.header
        scheduler = self.loop.core.scheduler

        def store() -> int:
            return scheduler.commit_cache_import(header.request_id, list(header.prompt_token_ids))

        self.num_new_blocks = await self.loop.call(store, wake=wake_loop)
        self._committed = True
        log.debug("host tier: %d new blocks of %d tokens from %s", self.num_new_blocks,
                  len(header.prompt_token_ids), header.source_engine)
        return self.loop.core.config.name
