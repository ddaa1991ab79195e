"""Reference-counted KV block allocator: pure bookkeeping, no tensors.

Block ids are the integers ``0 .. num_blocks - 1``; the KV storage layer maps an
id to a slice of its tensors. A block is *free* at refcount 0 and *used* above.

Free list order is LIFO (a stack): the most recently freed block is handed out
first, which keeps hot blocks hot and makes every allocation sequence exactly
reproducible. A fresh allocator hands out ``0, 1, 2, ...`` in order, and
``free(ids)`` pushes ids in reverse so that an immediate ``allocate(len(ids))``
returns the same ids in the same order.

Every operation is O(1) per block id and validates its whole argument before
changing anything, so a raised error leaves the allocator untouched.
"""

from collections import Counter
from collections.abc import Iterable

from dualpace.errors import DualPaceError


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
    """Hands out block ids and counts references to them."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._refcounts: list[int] = [0] * num_blocks
        # Stack: the end of the list is handed out next.
        self._free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_total_blocks(self) -> int:
        """All blocks this allocator manages."""
        return len(self._refcounts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0."""
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount >= 1."""
        return self.num_total_blocks - self.num_free_blocks

    def refcount(self, block_id: int) -> int:
        """Number of references to ``block_id`` (0 when free)."""
        self._check_id(block_id)
        return self._refcounts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (refcount 1 each), all or nothing.

        Raises OutOfBlocks when fewer are free; nothing changes then.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free_block_ids):
            raise OutOfBlocks(num_blocks, self.num_free_blocks, self.num_total_blocks)
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id = self._free_block_ids.pop()
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

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; a block at refcount 0 returns to the free pool.

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
                self._free_block_ids.append(block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < len(self._refcounts):
            raise ValueError(
                f"KV block id {block_id} out of range 0..{len(self._refcounts) - 1}"
            )
