"""Reference-counted KV block allocator with a prefix cache: pure bookkeeping, no tensors.

Block ids are the integers ``0 .. num_blocks - 1``; the KV storage layer maps an
id to a slice of its tensors. Every block is in exactly one of three states:

- *used*: refcount >= 1 (some sequence holds it); it may also carry a content hash;
- *cached*: refcount 0 but its content hash is registered, so a later sequence with
  the same prefix can take it back (an *evictable* block);
- *free*: refcount 0 and no hash.

``num_free_blocks + num_cached_blocks + num_used_blocks == num_total_blocks`` always.
An allocation takes free blocks first, then evicts cached ones, least recently
freed first; a block that any sequence references is never evicted.

Free list order is LIFO (a stack): the most recently freed block is handed out
first, which keeps hot blocks hot and makes every allocation sequence exactly
reproducible. A fresh allocator hands out ``0, 1, 2, ...`` in order, and
``free(ids)`` pushes ids in reverse so that an immediate ``allocate(len(ids))``
returns the same ids in the same order. The same reversal puts a freed table's
*last* cached block first in line for eviction: tails are shared least.

Every operation is O(1) per block id and validates its whole argument before
changing anything, so a raised error leaves the allocator untouched.
"""

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from dualpace.errors import DualPaceError

BlockHash = bytes


class OutOfBlocks(DualPaceError):
    """Not enough free KV blocks for an all-or-nothing allocation."""

    def __init__(self, num_requested_blocks: int, num_free_blocks: int, num_total_blocks: int):
        super().__init__(
            f"out of KV blocks: need {num_requested_blocks}, "
            f"only {num_free_blocks} free of {num_total_blocks}"
        )
        self.num_requested_blocks = num_requested_blocks
        self.num_free_blocks = num_free_blocks
        self.num_total_blocks = num_total_blocks


class BlockAllocator:
    """Hands out block ids, counts references to them and keeps freed full blocks cached."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._refcounts: list[int] = [0] * num_blocks
        # Stack: the end of the list is handed out next.
        self._free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._hash_of_block: dict[int, BlockHash] = {}
        self._block_of_hash: dict[BlockHash, int] = {}
        # Unreferenced blocks with a hash, least recently freed first (evicted first).
        self._evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0  # cached blocks taken back for new content
        self.on_forget: Callable[[BlockHash], None] | None = None  # told each hash that leaves the cache

    @property
    def num_total_blocks(self) -> int:
        """All blocks this allocator manages."""
        return len(self._refcounts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 and no cached content."""
        return len(self._free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with refcount 0 whose content stays cached until evicted."""
        return len(self._evictable_block_ids)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take now: free ones, then evicted cached ones."""
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount >= 1."""
        return self.num_total_blocks - self.num_available_blocks

    def refcount(self, block_id: int) -> int:
        """Number of references to ``block_id`` (0 when free or cached)."""
        self._check_id(block_id)
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The content hash registered for ``block_id``, if any."""
        self._check_id(block_id)
        return self._hash_of_block.get(block_id)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding content ``block_hash`` (used or cached), or None."""
        return self._block_of_hash.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (refcount 1 each), all or nothing: free blocks first,
        then cached ones in eviction order (their content is forgotten).

        Raises OutOfBlocks when fewer are available; nothing changes then.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_available_blocks:
            raise OutOfBlocks(num_blocks, self.num_available_blocks, self.num_total_blocks)
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_block_ids:
                block_id = self._free_block_ids.pop()
            else:
                block_id, _ = self._evictable_block_ids.popitem(last=False)
                self._forget_hash(block_id)
                self.num_evictions += 1
            self._refcounts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each id (repeats count repeatedly); ids must be in use."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._refcounts[block_id] == 0:
                raise ValueError(f"cannot incref KV block {block_id}: it is free")
        for block_id in block_ids:
            self._refcounts[block_id] += 1

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each cached-content block, used or cached (then no longer evictable)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if block_id not in self._hash_of_block:
                raise ValueError(f"cannot share KV block {block_id}: it holds no cached content")
        for block_id in block_ids:
            self._evictable_block_ids.pop(block_id, None)
            self._refcounts[block_id] += 1

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that used block ``block_id`` now holds the full content ``block_hash``.

        False (nothing changes) when another block already holds that content: the
        first copy stays the cached one and this block is freed plainly later.
        """
        self._check_id(block_id)
        if self._refcounts[block_id] == 0:
            raise ValueError(f"cannot register KV block {block_id}: it is not in use")
        if block_id in self._hash_of_block:
            raise ValueError(f"KV block {block_id} already holds cached content")
        if block_hash in self._block_of_hash:
            return False
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        return True

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; at refcount 0 a block with cached content becomes
        cached (most recently freed: evicted last), any other becomes free.

        Raises ValueError (changing nothing) if any id would drop below 0,
        e.g. freeing a block that is already free.
        """
        block_ids = list(block_ids)
        for block_id, num_drops in Counter(block_ids).items():
            self._check_id(block_id)
            if num_drops > self._refcounts[block_id]:
                raise ValueError(
                    f"cannot free KV block {block_id} {num_drops} time(s): "
                    f"its refcount is {self._refcounts[block_id]}"
                )
        for block_id in reversed(block_ids):
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] == 0:
                if block_id in self._hash_of_block:
                    self._evictable_block_ids[block_id] = None
                else:
                    self._free_block_ids.append(block_id)

    def clear_cache(self) -> list[BlockHash]:
        """Forget every cached block no sequence references (they become free); their hashes."""
        dropped = []
        while self._evictable_block_ids:
            block_id, _ = self._evictable_block_ids.popitem(last=False)
            dropped.append(self._forget_hash(block_id))
            self._free_block_ids.append(block_id)
        return dropped

    def _forget_hash(self, block_id: int) -> BlockHash:
        block_hash = self._hash_of_block.pop(block_id)
        del self._block_of_hash[block_hash]
        if self.on_forget is not None:
            self.on_forget(block_hash)
        return block_hash

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < len(self._refcounts):
            raise ValueError(
                f"KV block id {block_id} out of range 0..{len(self._refcounts) - 1}"
            )
