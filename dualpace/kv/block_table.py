"""Per-sequence KV block tables on top of the reference-counted allocator.

Pure bookkeeping (no tensors): a sequence's tokens fill its blocks in order,
``block_size`` tokens per block, so position ``p`` lives in block
``block_ids[p // block_size]`` at offset ``p % block_size`` — flat slot
``block_id * block_size + offset`` in the storage layer.

Sharing: ``fork`` lets a child share all of its parent's blocks. Only the last
block of a table can be partially filled, and only it is ever written again, so
when an ``append`` would write into a shared, partially filled last block the
manager gives the writer a private copy (copy-on-write) and reports the
``(src_block_id, dst_block_id)`` pair for the storage layer to copy.

Prefix cache: ``register_full_blocks`` records the content hash (dualpace.kv.prefix_hash)
of each block a sequence has filled; ``match_prefix`` finds the longest run of cached
blocks for a chain of hashes, and ``allocate(..., cached_block_ids)`` starts a new table
with them, shared (refcounted). Cached blocks are always full, so they are never written
again; a freed one stays cached until an allocation evicts it.

Sliding window: ``release_leading_blocks`` returns a table's leading blocks to the pool while the
sequence runs (the window of every layer the pool serves has passed them). The table keeps its
logical indexing: a released entry reads ``FREED_BLOCK_ID``, which holds no KV and is never written;
``readable_block_ids`` gives attention a table with each such entry replaced by a held block, whose
positions the window masks.

Every mutating method checks everything (ids, sizes, free blocks) before it
changes anything: a raised error leaves the manager untouched.
"""

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from dualpace.kv.allocator import BlockAllocator, BlockHash, OutOfBlocks

SeqId = Hashable
FREED_BLOCK_ID = -1  # a table entry whose block a sliding window returned to the pool


@dataclass(frozen=True)
class AppendResult:
    """What ``KVBlockManager.append`` changed in one table.

    ``new_block_ids``: blocks added to the end of the table (in table order);
    a copy-on-write destination is the first of them.
    ``copies``: ``(src_block_id, dst_block_id)`` pairs whose used slots the
    storage layer must copy before writing the new tokens' KV.
    """

    new_block_ids: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()


@dataclass
class _SeqBlocks:
    """One sequence's block table and how many token slots it has filled."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_hashed_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_released_blocks: int = 0  # leading entries returned to the pool (FREED_BLOCK_ID)

    def held_block_ids(self) -> list[int]:
        return self.block_ids[self.num_released_blocks:]


class KVBlockManager:
    """Block tables keyed by a hashable sequence / request id."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._allocator = BlockAllocator(num_blocks)
        self._seqs: dict[SeqId, _SeqBlocks] = {}

    # -- pool ----------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """All blocks in the pool."""
        return self._allocator.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds and no cached content fills."""
        return self._allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one table."""
        return self._allocator.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no table holds whose content stays cached until evicted."""
        return self._allocator.num_cached_blocks

    @property
    def num_available_blocks(self) -> int:
        """Blocks a new allocation may take: free, then evicted cached ones."""
        return self._allocator.num_available_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far."""
        return self._allocator.num_evictions

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The content hash of a cached-content block, else None."""
        return self._allocator.block_hash(block_id)

    def refcount(self, block_id: int) -> int:
        """How many tables hold ``block_id``."""
        return self._allocator.refcount(block_id)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        _check_count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)

    # -- sequences -----------------------------------------------------------

    def has(self, seq_id: SeqId) -> bool:
        """Whether ``seq_id`` has a block table."""
        return seq_id in self._seqs

    def seq_ids(self) -> list[SeqId]:
        """Ids with a block table, in the order they were created."""
        return list(self._seqs)

    def block_ids(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._get(seq_id).block_ids)

    def num_held_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence's table holds (its released entries not counted)."""
        return len(self._get(seq_id).held_block_ids())

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots the sequence has reserved (prompt + appended)."""
        return self._get(seq_id).num_tokens

    def slot_ids(self, seq_id: SeqId, start_pos: int, end_pos: int) -> list[int]:
        """Flat storage slots of positions ``start_pos <= p < end_pos``."""
        seq = self._slot_range(seq_id, start_pos, end_pos)
        size = self.block_size
        return [seq.block_ids[p // size] * size + p % size for p in range(start_pos, end_pos)]

    def slot_runs(self, seq_id: SeqId, start_pos: int, end_pos: int) -> tuple[tuple[int, int], ...]:
        """``slot_ids`` of the same positions as (first slot, number of slots) runs of consecutive slots,
        in position order: a step per block, not per position (a same-host transfer names its target
        slots so; 1024 positions' list cost ~0.2 ms, built and then walked, on a target woken from idle)."""
        block_ids = self._slot_range(seq_id, start_pos, end_pos).block_ids
        size = self.block_size
        starts: list[int] = []
        lengths: list[int] = []
        pos = start_pos
        while pos < end_pos:
            count = min(size - pos % size, end_pos - pos)  # to the end of this block, or of the range
            slot = block_ids[pos // size] * size + pos % size
            if starts and slot == starts[-1] + lengths[-1]:
                lengths[-1] += count
            else:
                starts.append(slot)
                lengths.append(count)
            pos += count
        return tuple(zip(starts, lengths))

    def num_released_tokens(self, seq_id: SeqId) -> int:
        """Leading positions whose blocks ``release_leading_blocks`` returned to the pool."""
        return self._get(seq_id).num_released_blocks * self.block_size

    def match_prefix(self, block_hashes: list[BlockHash]) -> list[int]:
        """Blocks holding the longest cached run of ``block_hashes`` from the first."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._allocator.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def match_prefix_in_window(self, block_hashes: list[BlockHash], window_tokens: int) -> list[int]:
        """For a pool whose every layer slides over ``window_tokens``: the longest cached run of
        ``block_hashes`` whose blocks the next query's window reaches are all cached, those before
        it given as FREED_BLOCK_ID (never held again; a new table starts released there)."""
        num_hit_blocks = first_needed = 0
        run_start = 0  # first index of the current unbroken run of cached blocks
        block_ids: list[int] = []
        for index, block_hash in enumerate(block_hashes):
            block_id = self._allocator.lookup(block_hash)
            block_ids.append(FREED_BLOCK_ID if block_id is None else block_id)
            if block_id is None:
                run_start = index + 1
                continue
            needed_from = max(0, (index + 1) * self.block_size - window_tokens + 1) // self.block_size
            if run_start <= needed_from:
                num_hit_blocks, first_needed = index + 1, needed_from
        return [FREED_BLOCK_ID] * first_needed + block_ids[first_needed:num_hit_blocks]

    def num_blocks_to_take(self, num_tokens: int, cached_block_ids: list[int] = ()) -> int:
        """Available blocks ``allocate(_, num_tokens, cached_block_ids)`` consumes: the new
        blocks plus the cached blocks it takes back from the evictable pool."""
        num_new = self.num_blocks_for(num_tokens) - len(cached_block_ids)
        return max(num_new, 0) + sum(b != FREED_BLOCK_ID and self._allocator.refcount(b) == 0
                                     for b in cached_block_ids)

    def can_allocate(self, num_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens fits now."""
        return self.num_blocks_to_take(num_tokens, cached_block_ids) <= self.num_available_blocks

    def allocate(self, seq_id: SeqId, num_tokens: int, cached_block_ids: list[int] = ()) -> list[int]:
        """Create a table for a new sequence holding ``num_tokens`` tokens, whose leading
        blocks are ``cached_block_ids`` (shared, from ``match_prefix``) and the rest new.

        Raises ValueError if ``seq_id`` exists or the cached blocks are not cached content
        that fits, OutOfBlocks if it does not fit.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has KV blocks")
        cached_block_ids = list(cached_block_ids)
        num_released = _num_leading(cached_block_ids, FREED_BLOCK_ID)
        shared_block_ids = cached_block_ids[num_released:]
        if len(cached_block_ids) * self.block_size > num_tokens:
            raise ValueError(f"{len(cached_block_ids)} cached blocks hold more than {num_tokens} tokens")
        if any(b == FREED_BLOCK_ID or self._allocator.block_hash(b) is None for b in shared_block_ids):
            raise ValueError("a block passed as cached holds no cached content")
        needed = self.num_blocks_to_take(num_tokens, cached_block_ids)
        if needed > self.num_available_blocks:
            raise OutOfBlocks(needed, self.num_available_blocks, self.num_total_blocks)
        self._allocator.share(shared_block_ids)
        new_block_ids = self._allocator.allocate(self.num_blocks_for(num_tokens) - len(cached_block_ids))
        block_ids = cached_block_ids + new_block_ids
        self._seqs[seq_id] = _SeqBlocks(block_ids, num_tokens, len(cached_block_ids), num_released)
        return list(block_ids)

    def register_full_blocks(self, seq_id: SeqId, block_hashes: list[BlockHash], num_full_blocks: int) -> list[int]:
        """Offer the sequence's first ``num_full_blocks`` blocks (full, their KV written), whose
        content hashes lead ``block_hashes``, to the prefix cache; returns the table indexes of
        the blocks that entered it (not those it already held)."""
        seq = self._get(seq_id)
        if num_full_blocks <= seq.num_hashed_blocks:
            return []
        if not num_full_blocks <= len(block_hashes) or num_full_blocks * self.block_size > seq.num_tokens:
            raise ValueError(f"{num_full_blocks} full blocks ({len(block_hashes)} hashes) "
                             f"in a sequence of {seq.num_tokens} tokens")
        registered = []
        for index in range(max(seq.num_hashed_blocks, seq.num_released_blocks), num_full_blocks):
            block_id = seq.block_ids[index]
            if self._allocator.block_hash(block_id) is None and self._allocator.register(block_id, block_hashes[index]):
                registered.append(index)
        seq.num_hashed_blocks = num_full_blocks
        return registered

    def set_forget_listener(self, listener: Callable[[BlockHash], None] | None) -> None:
        """Call ``listener(hash)`` whenever a block's content leaves the cache (evicted or cleared)."""
        self._allocator.on_forget = listener

    def clear_cache(self) -> int:
        """Forget every cached block no table holds; how many."""
        return len(self._allocator.clear_cache())

    def can_append(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        """Whether ``append(seq_id, num_new_tokens)`` would succeed now."""
        return self._num_blocks_to_append(self._get(seq_id), num_new_tokens) <= self.num_available_blocks

    def append(self, seq_id: SeqId, num_new_tokens: int) -> AppendResult:
        """Reserve slots for ``num_new_tokens`` more tokens, copying-on-write if needed.

        Raises KeyError for an unknown id, OutOfBlocks (changing nothing) if the
        blocks are not free.
        """
        seq = self._get(seq_id)
        num_needed_blocks = self._num_blocks_to_append(seq, num_new_tokens)
        if num_needed_blocks > self.num_available_blocks:
            raise OutOfBlocks(num_needed_blocks, self.num_available_blocks, self.num_total_blocks)
        new_block_ids = self._allocator.allocate(num_needed_blocks)
        copies: tuple[tuple[int, int], ...] = ()
        if self._needs_copy_on_write(seq, num_new_tokens):
            src_block_id = seq.block_ids.pop()
            self._allocator.free([src_block_id])  # still held by its other owners
            copies = ((src_block_id, new_block_ids[0]),)
        seq.block_ids.extend(new_block_ids)
        seq.num_tokens += num_new_tokens
        return AppendResult(tuple(new_block_ids), copies)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give ``child_id`` a table sharing every block of ``parent_id``."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into sequence {child_id!r}: it already has KV blocks")
        self._allocator.incref(parent.held_block_ids())
        self._seqs[child_id] = _SeqBlocks(list(parent.block_ids), parent.num_tokens, parent.num_hashed_blocks,
                                          parent.num_released_blocks)

    def hand_over(self, seq_id: SeqId, new_id: SeqId, num_tokens: int) -> None:
        """Give ``seq_id``'s table to ``new_id``, cut to its first ``num_tokens`` tokens (the blocks past
        them freed): an import reserved ahead, before its request was known. Only for a table that
        holds its blocks alone (no sharing, none cached or released)."""
        seq = self._get(seq_id)
        if new_id in self._seqs:
            raise ValueError(f"sequence {new_id!r} already has KV blocks")
        _check_count("num_tokens", num_tokens)
        if num_tokens > seq.num_tokens:
            raise ValueError(f"{num_tokens} tokens do not fit sequence {seq_id!r} of {seq.num_tokens}")
        if seq.num_hashed_blocks or seq.num_released_blocks or any(self._allocator.refcount(b) != 1
                                                                  for b in seq.block_ids):
            raise ValueError(f"sequence {seq_id!r} shares, caches or released blocks")
        keep = self.num_blocks_for(num_tokens)
        self._allocator.free(seq.block_ids[keep:])
        del self._seqs[seq_id]
        self._seqs[new_id] = _SeqBlocks(seq.block_ids[:keep], num_tokens)

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence's table; blocks no other table holds become free (or cached)."""
        seq = self._get(seq_id)
        self._allocator.free(seq.held_block_ids())
        del self._seqs[seq_id]

    def release_leading_blocks(self, seq_id: SeqId, num_blocks: int) -> int:
        """Return the table's blocks before index ``num_blocks`` (its last block always kept) to the
        pool: no window reaches them any more. Their entries become FREED_BLOCK_ID; a block other
        tables share stays theirs, one with cached content stays cached. How many were released now."""
        seq = self._get(seq_id)
        _check_count("num_blocks", num_blocks)
        end = min(num_blocks, len(seq.block_ids) - 1)
        if end <= seq.num_released_blocks:
            return 0
        released = seq.block_ids[seq.num_released_blocks:end]
        self._allocator.free(released[::-1])  # cached ones evicted from the first: a window reuses the last
        seq.block_ids[seq.num_released_blocks:end] = [FREED_BLOCK_ID] * len(released)
        seq.num_released_blocks = end
        return len(released)

    # -- helpers -------------------------------------------------------------

    def _slot_range(self, seq_id: SeqId, start_pos: int, end_pos: int) -> _SeqBlocks:
        """The sequence, once positions [start_pos, end_pos) are checked: inside it, none released."""
        seq = self._get(seq_id)
        if not 0 <= start_pos <= end_pos <= seq.num_tokens:
            raise ValueError(
                f"slot range [{start_pos}, {end_pos}) outside sequence {seq_id!r} "
                f"with {seq.num_tokens} tokens"
            )
        if start_pos < end_pos and start_pos < seq.num_released_blocks * self.block_size:
            raise ValueError(f"positions [{start_pos}, {seq.num_released_blocks * self.block_size}) of sequence "
                             f"{seq_id!r} were returned to the pool (outside the sliding window)")
        return seq

    def _get(self, seq_id: SeqId) -> _SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}: it has no KV blocks") from None

    def _needs_copy_on_write(self, seq: _SeqBlocks, num_new_tokens: int) -> bool:
        """New tokens would land in a shared, partially filled last block."""
        return (
            num_new_tokens > 0
            and seq.num_tokens % self.block_size != 0
            and self._allocator.refcount(seq.block_ids[-1]) > 1
        )

    def _num_blocks_to_append(self, seq: _SeqBlocks, num_new_tokens: int) -> int:
        _check_count("num_new_tokens", num_new_tokens)
        num_growth_blocks = self.num_blocks_for(seq.num_tokens + num_new_tokens) - len(seq.block_ids)
        return num_growth_blocks + int(self._needs_copy_on_write(seq, num_new_tokens))


def readable_block_ids(block_ids: list[int]) -> list[int]:
    """``block_ids`` with each FREED_BLOCK_ID replaced by the table's last (always held) block: attention
    gathers whole tables, and the window masks every position of a released entry."""
    if FREED_BLOCK_ID not in block_ids:
        return block_ids
    return [block_ids[-1] if block_id == FREED_BLOCK_ID else block_id for block_id in block_ids]


def _num_leading(values: list[int], value: int) -> int:
    count = 0
    while count < len(values) and values[count] == value:
        count += 1
    return count


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


__all__ = ["FREED_BLOCK_ID", "AppendResult", "KVBlockManager", "OutOfBlocks", "SeqId", "readable_block_ids"]
