"""Hypothesis state machine over KVBlockManager: allocate, append, fork, free, and the
prefix cache (register full blocks, allocate on a matched prefix, evict).

Besides the bookkeeping invariants, a fake slot store records which token
each slot holds; after every step each sequence must read back exactly its own
tokens through ``slot_ids``, which catches a write into a block another
sequence still shares (a missing or wrong copy-on-write), a cached block handed
out while referenced, or a matched block whose content is not what its hash says.
"""

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dualpace.kv.allocator import OutOfBlocks
from dualpace.kv.block_table import FREED_BLOCK_ID, KVBlockManager
from dualpace.kv.prefix_hash import BlockHasher


class KVBlockManagerMachine(RuleBasedStateMachine):
    """Drives one manager and checks it against a token-level model."""

    @initialize(num_blocks=st.integers(0, 12), block_size=st.integers(1, 4))
    def make_manager(self, num_blocks: int, block_size: int) -> None:
        self.manager = KVBlockManager(num_blocks, block_size)
        self.hasher = BlockHasher(block_size, "state-machine")
        self.registered_token_lists: list[list[int]] = []  # contents offered to the cache, for later matches
        self.expected_tokens: dict[int, list[int]] = {}  # seq id -> token values in order
        self.slot_values: dict[int, int] = {}  # flat slot -> token value stored there
        self.next_seq_id = itertools.count()
        self.next_token = itertools.count()

    # -- helpers ---------------------------------------------------------------

    def _snapshot(self) -> tuple:
        manager = self.manager
        tables = {s: (manager.block_ids(s), manager.num_tokens(s)) for s in manager.seq_ids()}
        refcounts = [manager.refcount(b) for b in range(manager.num_total_blocks)]
        return tables, refcounts, manager.num_free_blocks

    def _pick(self, index: int) -> int:
        seq_ids = self.manager.seq_ids()
        return seq_ids[index % len(seq_ids)]

    def _write_tokens(self, seq_id: int, start_pos: int, end_pos: int) -> None:
        for slot_id in self.manager.slot_ids(seq_id, start_pos, end_pos):
            token = next(self.next_token)
            self.slot_values[slot_id] = token
            self.expected_tokens[seq_id].append(token)

    # -- rules -----------------------------------------------------------------

    @rule(num_tokens=st.integers(0, 20))
    def allocate(self, num_tokens: int) -> None:
        seq_id = next(self.next_seq_id)
        fits = self.manager.can_allocate(num_tokens)
        before = self._snapshot()
        try:
            block_ids = self.manager.allocate(seq_id, num_tokens)
        except OutOfBlocks:
            assert not fits
            assert self._snapshot() == before
            return
        assert fits
        assert block_ids == self.manager.block_ids(seq_id)
        self.expected_tokens[seq_id] = []
        self._write_tokens(seq_id, 0, num_tokens)

    @precondition(lambda self: self.manager.seq_ids())
    @rule(index=st.integers(0, 100), num_new_tokens=st.integers(0, 9))
    def append(self, index: int, num_new_tokens: int) -> None:
        seq_id = self._pick(index)
        fits = self.manager.can_append(seq_id, num_new_tokens)
        before = self._snapshot()
        old_num_tokens = self.manager.num_tokens(seq_id)
        try:
            result = self.manager.append(seq_id, num_new_tokens)
        except OutOfBlocks:
            assert not fits
            assert self._snapshot() == before
            return
        assert fits
        old_block_ids = before[0][seq_id][0]
        block_size = self.manager.block_size
        for src_block_id, dst_block_id in result.copies:
            assert src_block_id == old_block_ids[-1]
            assert dst_block_id in result.new_block_ids
            for offset in range(block_size):
                src_slot = src_block_id * block_size + offset
                if src_slot in self.slot_values:
                    self.slot_values[dst_block_id * block_size + offset] = self.slot_values[src_slot]
        new_block_ids = list(result.new_block_ids)
        kept_block_ids = old_block_ids[:-1] if result.copies else old_block_ids
        assert self.manager.block_ids(seq_id) == kept_block_ids + new_block_ids
        self._write_tokens(seq_id, old_num_tokens, old_num_tokens + num_new_tokens)

    @precondition(lambda self: self.manager.seq_ids())
    @rule(index=st.integers(0, 100))
    def fork(self, index: int) -> None:
        parent_id = self._pick(index)
        child_id = next(self.next_seq_id)
        num_free_before = self.manager.num_free_blocks
        self.manager.fork(parent_id, child_id)
        assert self.manager.num_free_blocks == num_free_before
        self.expected_tokens[child_id] = list(self.expected_tokens[parent_id])

    @precondition(lambda self: self.manager.seq_ids())
    @rule(index=st.integers(0, 100))
    def register(self, index: int) -> None:
        seq_id = self._pick(index)
        tokens = self.expected_tokens[seq_id]
        block_hashes = self.hasher.chain(tokens)
        used_before = self.manager.num_used_blocks
        self.manager.register_full_blocks(seq_id, block_hashes, len(block_hashes))
        assert self.manager.num_used_blocks == used_before
        self.registered_token_lists.append(list(tokens))

    def _donor_prefix(self, index: int, num_prefix_blocks: int) -> list[int]:
        donor = self.registered_token_lists[index % len(self.registered_token_lists)]
        size = self.manager.block_size
        return donor[: min(num_prefix_blocks, len(donor) // size) * size]

    def _allocate_on(self, prefix: list[int], cached_block_ids: list[int], num_new_tokens: int) -> None:
        """A new table on the matched blocks plus new tokens; all or nothing."""
        num_cached_tokens = len(cached_block_ids) * self.manager.block_size
        num_tokens = num_cached_tokens + num_new_tokens
        seq_id = next(self.next_seq_id)
        fits = self.manager.can_allocate(num_tokens, cached_block_ids)
        before = self._snapshot()
        try:
            block_ids = self.manager.allocate(seq_id, num_tokens, cached_block_ids)
        except OutOfBlocks:
            assert not fits
            assert self._snapshot() == before
            return
        assert fits
        assert block_ids[: len(cached_block_ids)] == cached_block_ids
        # The matched blocks must already hold the donor's tokens: nothing overwrote them.
        self.expected_tokens[seq_id] = list(prefix[:num_cached_tokens])
        self._write_tokens(seq_id, num_cached_tokens, num_tokens)

    @precondition(lambda self: self.registered_token_lists)
    @rule(index=st.integers(0, 100), num_prefix_blocks=st.integers(0, 5), num_new_tokens=st.integers(0, 9))
    def allocate_on_prefix(self, index: int, num_prefix_blocks: int, num_new_tokens: int) -> None:
        prefix = self._donor_prefix(index, num_prefix_blocks)
        self._allocate_on(prefix, self.manager.match_prefix(self.hasher.chain(prefix)), num_new_tokens)

    @precondition(lambda self: self.registered_token_lists)
    @rule(index=st.integers(0, 100), num_prefix_blocks=st.integers(0, 5), window_tokens=st.integers(1, 12),
          num_new_tokens=st.integers(0, 9))
    def allocate_on_prefix_in_window(self, index: int, num_prefix_blocks: int, window_tokens: int,
                                     num_new_tokens: int) -> None:
        """A sliding window's match: leading entries may be released, the window's blocks are cached."""
        prefix = self._donor_prefix(index, num_prefix_blocks)
        cached_block_ids = self.manager.match_prefix_in_window(self.hasher.chain(prefix), window_tokens)
        first_needed_block = max(0, len(cached_block_ids) * self.manager.block_size - window_tokens + 1) \
            // self.manager.block_size
        assert all(b == FREED_BLOCK_ID for b in cached_block_ids[:first_needed_block])
        assert FREED_BLOCK_ID not in cached_block_ids[first_needed_block:]
        self._allocate_on(prefix, cached_block_ids, num_new_tokens)

    @precondition(lambda self: self.manager.seq_ids())
    @rule(index=st.integers(0, 100), num_blocks=st.integers(0, 6))
    def release_leading(self, index: int, num_blocks: int) -> None:
        seq_id = self._pick(index)
        held_before, used_before = self.manager.num_held_blocks(seq_id), self.manager.num_used_blocks
        num_released = self.manager.release_leading_blocks(seq_id, num_blocks)
        assert self.manager.num_held_blocks(seq_id) == held_before - num_released
        assert self.manager.num_used_blocks <= used_before
        assert held_before == 0 or self.manager.num_held_blocks(seq_id) >= 1  # the last block is kept

    @precondition(lambda self: self.manager.seq_ids())
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        seq_id = self._pick(index)
        self.manager.free(seq_id)
        del self.expected_tokens[seq_id]
        assert not self.manager.has(seq_id)

    # -- invariants ------------------------------------------------------------

    @invariant()
    def counts_add_up(self) -> None:
        manager = self.manager
        total = manager.num_total_blocks
        assert manager.num_free_blocks + manager.num_cached_blocks + manager.num_used_blocks == total
        assert manager.num_available_blocks == manager.num_free_blocks + manager.num_cached_blocks
        num_nonzero = sum(manager.refcount(b) > 0 for b in range(total))
        assert num_nonzero == manager.num_used_blocks
        num_cached = sum(manager.refcount(b) == 0 and manager.block_hash(b) is not None for b in range(total))
        assert num_cached == manager.num_cached_blocks

    @invariant()
    def refcounts_match_tables(self) -> None:
        manager = self.manager
        num_holders = [0] * manager.num_total_blocks
        for seq_id in manager.seq_ids():
            table = manager.block_ids(seq_id)
            num_released = manager.num_released_tokens(seq_id) // manager.block_size
            block_ids = table[num_released:]
            assert table[:num_released] == [FREED_BLOCK_ID] * num_released  # released entries lead
            assert len(block_ids) == len(set(block_ids)), "a block appears twice in one table"
            assert len(table) == manager.num_blocks_for(manager.num_tokens(seq_id))
            for block_id in block_ids:
                num_holders[block_id] += 1
        for block_id, count in enumerate(num_holders):
            assert manager.refcount(block_id) == count  # so no free block is in any table

    @invariant()
    def sequences_read_their_own_tokens(self) -> None:
        manager = self.manager
        assert sorted(manager.seq_ids()) == sorted(self.expected_tokens)
        for seq_id, tokens in self.expected_tokens.items():
            assert manager.num_tokens(seq_id) == len(tokens)
            first_held = min(manager.num_released_tokens(seq_id), len(tokens))
            slot_ids = manager.slot_ids(seq_id, first_held, len(tokens))
            assert [self.slot_values[s] for s in slot_ids] == tokens[first_held:]


KVBlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestKVBlockManagerMachine = KVBlockManagerMachine.TestCase
