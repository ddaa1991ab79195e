"""KV cache events of one engine's prefix cache: pure, no clock, no I/O.

The field set follows vLLM's and NVIDIA Dynamo's KV events, so an external KV-aware
router can consume them:

- ``stored``: consecutive full blocks entered the cache: their ``block_hashes`` (in
  order), the hash of the block before the first (``parent_block_hash``, None for a
  prompt's first block), their ``token_ids`` (all of them, in order), ``block_size`` and
  ``medium`` (gpu or cpu);
- ``removed``: blocks whose content left the cache (evicted for new content, or cleared);
- ``all_cleared``: the consumer must forget everything it knew about this engine.

Every event has an ``event_id``, increasing by one. The log keeps the latest events in a
bounded window (a watcher that falls behind it gets a fresh snapshot) and the set of
blocks in the cache now, so a new watcher (a restarted router) starts from
``snapshot()``: ``all_cleared`` followed by one ``stored`` per cached block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dualpace.kv.allocator import BlockHash

STORED, REMOVED, ALL_CLEARED = "stored", "removed", "all_cleared"
DEFAULT_MAX_EVENTS = 4096


@dataclass(frozen=True)
class KvEvent:
    event_id: int
    kind: str  # STORED | REMOVED | ALL_CLEARED
    block_hashes: tuple[BlockHash, ...] = ()
    parent_block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str = ""


class KvEventLog:
    def __init__(self, medium: str, block_size: int, max_events: int = DEFAULT_MAX_EVENTS):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.medium = medium
        self.block_size = block_size
        self._events: deque[KvEvent] = deque(maxlen=max_events)
        self._live: dict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = {}  # hash -> (parent, tokens)
        self.last_event_id = 0

    def stored(self, block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
               token_ids: Sequence[int]) -> None:
        """Consecutive full blocks entered the cache (token_ids: block_size per block)."""
        if len(token_ids) != len(block_hashes) * self.block_size:
            raise ValueError(f"{len(token_ids)} token ids for {len(block_hashes)} blocks of {self.block_size}")
        parent = parent_block_hash
        for index, block_hash in enumerate(block_hashes):
            self._live[block_hash] = (parent, tuple(token_ids[index * self.block_size:(index + 1) * self.block_size]))
            parent = block_hash
        self._append(STORED, tuple(block_hashes), parent_block_hash, tuple(token_ids))

    def removed(self, block_hash: BlockHash) -> None:
        """One block's content left the cache."""
        self._live.pop(block_hash, None)
        self._append(REMOVED, (block_hash,))

    def all_cleared(self) -> None:
        self._live.clear()
        self._append(ALL_CLEARED)

    def since(self, event_id: int) -> list[KvEvent] | None:
        """Events after ``event_id``, or None when some of them already left the window."""
        if event_id >= self.last_event_id:
            return []
        oldest = self._events[0].event_id if self._events else self.last_event_id + 1
        if event_id + 1 < oldest:
            return None
        return [event for event in self._events if event.event_id > event_id]

    def snapshot(self) -> list[KvEvent]:
        """What a new watcher needs: all_cleared, then every cached block (as of last_event_id)."""
        events = [KvEvent(self.last_event_id, ALL_CLEARED, medium=self.medium)]
        for block_hash, (parent, token_ids) in self._live.items():
            events.append(KvEvent(self.last_event_id, STORED, (block_hash,), parent, token_ids,
                                  self.block_size, self.medium))
        return events

    @property
    def num_live_blocks(self) -> int:
        return len(self._live)

    def _append(self, kind: str, block_hashes: tuple[BlockHash, ...] = (),
                parent_block_hash: BlockHash | None = None, token_ids: tuple[int, ...] = ()) -> None:
        self.last_event_id += 1
        self._events.append(KvEvent(self.last_event_id, kind, block_hashes, parent_block_hash, token_ids,
                                    self.block_size, self.medium))
