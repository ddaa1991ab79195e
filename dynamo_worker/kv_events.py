"""Both engines' KV events -> the events of one Dynamo worker (the node). Pure: no grpc, no Dynamo.

Dynamo's KV router keeps a radix tree per worker. A stored event gives, per block, the block's
token ids (Dynamo hashes them itself into the tree's keys, so a new request's prefix matches by
content) and an identifier (`block_hashes`, signed 64-bit) that later events name: a child's
`parent_hash` and `removed`. Dynamo does not recompute identifiers; it needs them unique per
worker and consistent between stored and removed.

One node has two engines, and each names its blocks by its own hash, salted with its model and
weights format: the same prefix may be cached on both, under different hashes. So the view
re-keys every block by a chain over token ids alone (SHA-256 through dualpace.kv.prefix_hash,
under the salt NODE_SALT; its first 8 bytes are Dynamo's identifier) and counts how many engine
blocks hold each key: a key is published as stored when the first engine caches it, as removed
when the last one drops it. An engine whose blocks are larger than Dynamo's (a multiple of it)
is split into Dynamo-sized blocks; any other size is skipped and counted.

Dynamo's Python publisher (1.6.1) has no "all cleared" event, so `clear(source)` (an engine's
all_cleared, or its stream ending: it may have restarted with an empty cache) removes every key
only that engine held.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dualpace.kv.allocator import BlockHash
from dualpace.kv.events import ALL_CLEARED, REMOVED, STORED, KvEvent
from dualpace.kv.prefix_hash import BlockHasher

NODE_SALT = "dualpace-dynamo-node"


def dynamo_block_id(key: BlockHash) -> int:
    """A node key as Dynamo's block identifier: a signed 64-bit integer."""
    return int.from_bytes(key[:8], "big", signed=True)


class NodeKvView:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._hasher = BlockHasher(block_size, NODE_SALT)
        self._sources: dict[str, dict[BlockHash, tuple[BlockHash, ...]]] = {}  # engine hash -> node keys
        self._holders: dict[BlockHash, int] = {}  # node key -> engine blocks holding it
        self.num_skipped_blocks = 0  # of a block size Dynamo's cannot express, or an evicted parent

    @property
    def num_blocks(self) -> int:
        """Keys published as stored and not removed since."""
        return len(self._holders)

    def apply(self, source: str, events: Iterable[KvEvent]) -> list[dict]:
        """The Dynamo events (publish_batch's stored/removed dicts, in order) for `source`'s events."""
        out: list[dict] = []
        for event in events:
            if event.kind == ALL_CLEARED:
                out += self.clear(source)
            elif event.kind == REMOVED:
                blocks = self._sources.setdefault(source, {})
                out += self._release(blocks.pop(h, ()) for h in event.block_hashes)
            elif event.kind == STORED:
                out += self._store(self._sources.setdefault(source, {}), event)
        return out

    def clear(self, source: str) -> list[dict]:
        """Forget everything `source` held; the removals of keys no other engine holds."""
        return self._release(self._sources.pop(source, {}).values())

    def _release(self, key_groups: Iterable[tuple[BlockHash, ...]]) -> list[dict]:
        gone = []
        for keys in key_groups:
            for key in keys:
                count = self._holders.get(key, 0) - 1
                if count > 0:
                    self._holders[key] = count
                elif key in self._holders:
                    del self._holders[key]
                    gone.append(dynamo_block_id(key))
        return [{"type": "removed", "block_hashes": gone}] if gone else []

    def _store(self, blocks: dict[BlockHash, tuple[BlockHash, ...]], event: KvEvent) -> list[dict]:
        size = event.block_size
        if size < 1 or size % self.block_size or len(event.token_ids) != size * len(event.block_hashes):
            self.num_skipped_blocks += len(event.block_hashes)
            return []
        parent: BlockHash | None = None
        if event.parent_block_hash is not None:
            parent_keys = blocks.get(event.parent_block_hash)
            if not parent_keys:  # its parent left this engine's cache: unreachable for any prefix
                self.num_skipped_blocks += len(event.block_hashes)
                return []
            parent = parent_keys[-1]
        out: list[dict] = []
        run: dict | None = None  # consecutive keys new to the node: one stored event
        for index, engine_hash in enumerate(event.block_hashes):
            if engine_hash in blocks:  # stored twice by one engine: counted once
                parent, run = blocks[engine_hash][-1], None
                continue
            keys = []
            for tokens in _pieces(event.token_ids[index * size:(index + 1) * size], self.block_size):
                key = self._hasher.hash_block(parent, tokens)
                count = self._holders.get(key, 0)
                self._holders[key] = count + 1
                if count == 0:
                    if run is None:
                        run = {"type": "stored", "token_ids": [], "num_block_tokens": [], "block_hashes": [],
                               "parent_hash": None if parent is None else dynamo_block_id(parent)}
                        out.append(run)
                    run["token_ids"] += tokens
                    run["num_block_tokens"].append(self.block_size)
                    run["block_hashes"].append(dynamo_block_id(key))
                else:
                    run = None  # another engine holds it: Dynamo knows it already
                keys.append(key)
                parent = key
            blocks[engine_hash] = tuple(keys)
        return out


def _pieces(token_ids: Sequence[int], block_size: int) -> list[list[int]]:
    return [list(token_ids[i:i + block_size]) for i in range(0, len(token_ids), block_size)]
