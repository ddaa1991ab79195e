"""A router's index of which engine caches which prefix, built from the engines' KV events.
Pure: no grpc, no clock.

An engine's block hashes are salted with its model and weights format, which a router
need not know; a stored event carries the blocks' token ids and parent, so the index
re-keys every block by its own unsalted chain over token ids (one hasher per block
size). A request's cached prefix on an engine is then the longest run of the request's
own chain that the engine holds, in tokens. ``forget`` drops an engine (its stream broke;
the next subscription starts with a snapshot, which is how a restarted router rebuilds
the index).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dualpace.kv.allocator import BlockHash
from dualpace.kv.events import ALL_CLEARED, REMOVED, STORED, KvEvent
from dualpace.kv.prefix_hash import BlockHasher

ROUTER_SALT = "dualpace-router-index"


@dataclass
class _EngineBlocks:
    block_size: int = 0
    own_of_engine: dict[BlockHash, BlockHash] = field(default_factory=dict)  # engine hash -> index hash
    held: set[BlockHash] = field(default_factory=set)  # index hashes of the blocks cached there


class PrefixIndex:
    def __init__(self) -> None:
        self._engines: dict[str, _EngineBlocks] = {}
        self._hashers: dict[int, BlockHasher] = {}

    def apply(self, engine: str, events: Iterable[KvEvent]) -> None:
        blocks = self._engines.setdefault(engine, _EngineBlocks())
        for event in events:
            if event.kind == ALL_CLEARED:
                blocks.own_of_engine.clear()
                blocks.held.clear()
            elif event.kind == REMOVED:
                for engine_hash in event.block_hashes:
                    own = blocks.own_of_engine.pop(engine_hash, None)
                    if own is not None:
                        blocks.held.discard(own)
            elif event.kind == STORED:
                self._store(blocks, event)

    def forget(self, engine: str) -> None:
        self._engines.pop(engine, None)

    def num_blocks(self, engine: str) -> int:
        blocks = self._engines.get(engine)
        return 0 if blocks is None else len(blocks.held)

    def cached_prefix_tokens(self, engine: str, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` whose KV ``engine`` holds (whole blocks), as far as known."""
        blocks = self._engines.get(engine)
        if blocks is None or not blocks.held:
            return 0
        num_blocks = 0
        for own in self._hasher(blocks.block_size).chain(token_ids):
            if own not in blocks.held:
                break
            num_blocks += 1
        return num_blocks * blocks.block_size

    def _store(self, blocks: _EngineBlocks, event: KvEvent) -> None:
        if event.block_size < 1:
            return
        blocks.block_size = event.block_size
        hasher = self._hasher(event.block_size)
        if event.parent_block_hash is None:
            parent = None
        else:
            parent = blocks.own_of_engine.get(event.parent_block_hash)
            if parent is None:
                return  # its parent left the cache already: unreachable for any lookup
        for index, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * event.block_size:(index + 1) * event.block_size]
            parent = hasher.hash_block(parent, tokens)
            blocks.own_of_engine[engine_hash] = parent
            blocks.held.add(parent)

    def _hasher(self, block_size: int) -> BlockHasher:
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(block_size, ROUTER_SALT)
        return hasher


def longest_cached_prefix(index: PrefixIndex, engines: Sequence[str], token_ids: Sequence[int]) -> dict[str, int]:
    """Cached prefix tokens of ``token_ids`` per engine."""
    return {engine: index.cached_prefix_tokens(engine, token_ids) for engine in engines}
