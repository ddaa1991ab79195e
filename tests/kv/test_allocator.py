"""Unit tests for the KV block allocator and the per-sequence block manager."""

import pytest

from dualpace.errors import DualPaceError
from dualpace.kv.allocator import BlockAllocator, OutOfBlocks
from dualpace.kv.block_table import AppendResult, KVBlockManager

# -- BlockAllocator ------------------------------------------------------------


def test_fresh_allocator_counts_and_order():
    allocator = BlockAllocator(4)
    assert (allocator.num_total_blocks, allocator.num_free_blocks, allocator.num_used_blocks) == (4, 4, 0)
    assert allocator.allocate(3) == [0, 1, 2]
    assert (allocator.num_free_blocks, allocator.num_used_blocks) == (1, 3)
    assert [allocator.refcount(b) for b in range(4)] == [1, 1, 1, 0]


def test_allocate_zero_returns_nothing():
    allocator = BlockAllocator(2)
    assert allocator.allocate(0) == []
    assert allocator.num_free_blocks == 2


def test_free_list_is_lifo_and_reproducible():
    allocator = BlockAllocator(5)
    block_ids = allocator.allocate(4)
    allocator.free([block_ids[1], block_ids[3]])
    assert allocator.allocate(2) == [1, 3]  # freed ids come back in the order freed
    allocator.free([2])
    assert allocator.allocate(1) == [2]  # most recently freed first
    assert allocator.allocate(1) == [4]


def test_out_of_blocks_is_all_or_nothing():
    allocator = BlockAllocator(3)
    allocator.allocate(2)
    with pytest.raises(OutOfBlocks, match="need 2, only 1 free of 3") as info:
        allocator.allocate(2)
    assert isinstance(info.value, DualPaceError)
    assert (info.value.num_requested_blocks, info.value.num_free_blocks) == (2, 1)
    assert allocator.num_free_blocks == 1
    assert allocator.allocate(1) == [2]


def test_incref_and_free_follow_refcount():
    allocator = BlockAllocator(2)
    (block_id,) = allocator.allocate(1)
    allocator.incref([block_id, block_id])
    assert allocator.refcount(block_id) == 3
    allocator.free([block_id])
    allocator.free([block_id])
    assert allocator.refcount(block_id) == 1
    assert allocator.num_free_blocks == 1
    allocator.free([block_id])
    assert allocator.refcount(block_id) == 0
    assert allocator.num_free_blocks == 2


def test_free_of_free_block_raises_and_changes_nothing():
    allocator = BlockAllocator(3)
    allocator.allocate(1)
    with pytest.raises(ValueError, match="block 1"):
        allocator.free([0, 1])
    assert allocator.refcount(0) == 1
    with pytest.raises(ValueError, match="refcount is 1"):
        allocator.free([0, 0])
    assert allocator.refcount(0) == 1


def test_incref_of_free_block_raises():
    allocator = BlockAllocator(2)
    allocator.allocate(1)
    with pytest.raises(ValueError, match="free"):
        allocator.incref([0, 1])
    assert allocator.refcount(0) == 1


def test_bad_ids_and_sizes_raise():
    allocator = BlockAllocator(2)
    with pytest.raises(ValueError, match="out of range"):
        allocator.refcount(2)
    with pytest.raises(ValueError, match="out of range"):
        allocator.free([-1])
    with pytest.raises(ValueError):
        allocator.allocate(-1)
    with pytest.raises(ValueError):
        BlockAllocator(-1)


# -- KVBlockManager ------------------------------------------------------------


def test_num_blocks_for_rounds_up():
    manager = KVBlockManager(num_blocks=8, block_size=4)
    assert [manager.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        manager.num_blocks_for(-1)


def test_allocate_creates_table():
    manager = KVBlockManager(num_blocks=8, block_size=4)
    assert manager.can_allocate(10)
    assert manager.allocate("a", 10) == [0, 1, 2]
    assert manager.has("a") and not manager.has("b")
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.num_tokens("a") == 10
    assert manager.seq_ids() == ["a"]
    assert (manager.num_free_blocks, manager.num_used_blocks, manager.num_total_blocks) == (5, 3, 8)


def test_allocate_existing_id_raises():
    manager = KVBlockManager(num_blocks=8, block_size=4)
    manager.allocate(7, 1)
    with pytest.raises(ValueError, match="already has KV blocks"):
        manager.allocate(7, 1)


def test_allocate_out_of_blocks_changes_nothing():
    manager = KVBlockManager(num_blocks=2, block_size=4)
    assert not manager.can_allocate(9)
    with pytest.raises(OutOfBlocks):
        manager.allocate("a", 9)
    assert not manager.has("a")
    assert manager.num_free_blocks == 2


def test_append_within_last_block_allocates_nothing():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", 2)
    assert manager.append("a", 2) == AppendResult()
    assert manager.num_tokens("a") == 4
    assert manager.block_ids("a") == [0]


def test_append_grows_table():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", 4)
    assert manager.can_append("a", 5)
    result = manager.append("a", 5)
    assert result.new_block_ids == (1, 2)
    assert result.copies == ()
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.num_tokens("a") == 9


def test_append_zero_and_negative():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", 3)
    assert manager.append("a", 0) == AppendResult()
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.append("a", -1)


def test_append_out_of_blocks_changes_nothing():
    manager = KVBlockManager(num_blocks=2, block_size=4)
    manager.allocate("a", 4)
    assert not manager.can_append("a", 5)
    with pytest.raises(OutOfBlocks):
        manager.append("a", 5)
    assert manager.block_ids("a") == [0]
    assert manager.num_tokens("a") == 4
    assert manager.num_free_blocks == 1


def test_unknown_sequence_raises_key_error():
    manager = KVBlockManager(num_blocks=2, block_size=4)
    for call in (
        lambda: manager.append("x", 1),
        lambda: manager.can_append("x", 1),
        lambda: manager.free("x"),
        lambda: manager.block_ids("x"),
        lambda: manager.num_tokens("x"),
        lambda: manager.slot_ids("x", 0, 0),
        lambda: manager.fork("x", "y"),
    ):
        with pytest.raises(KeyError, match="unknown sequence 'x'"):
            call()


def test_fork_shares_blocks():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("p", 8)
    manager.fork("p", "c")
    assert manager.block_ids("c") == manager.block_ids("p") == [0, 1]
    assert manager.num_tokens("c") == 8
    assert manager.refcount(0) == manager.refcount(1) == 2
    assert manager.num_used_blocks == 2
    with pytest.raises(ValueError, match="cannot fork into sequence 'c'"):
        manager.fork("p", "c")


def test_append_after_fork_on_full_block_needs_no_copy():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("p", 4)
    manager.fork("p", "c")
    result = manager.append("c", 1)
    assert result == AppendResult(new_block_ids=(1,), copies=())
    assert manager.block_ids("c") == [0, 1]
    assert manager.refcount(0) == 2


def test_copy_on_write_of_shared_partial_last_block():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("p", 6)  # blocks 0 (full), 1 (2 of 4 slots)
    manager.fork("p", "c")
    assert manager.can_append("c", 1)
    result = manager.append("c", 1)
    assert result == AppendResult(new_block_ids=(2,), copies=((1, 2),))
    assert manager.block_ids("c") == [0, 2]
    assert manager.block_ids("p") == [0, 1]
    assert (manager.refcount(0), manager.refcount(1), manager.refcount(2)) == (2, 1, 1)
    # The parent is the sole owner of block 1 now: no further copy.
    assert manager.append("p", 2) == AppendResult()


def test_copy_on_write_plus_growth():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("p", 2)
    manager.fork("p", "c")
    result = manager.append("c", 3)  # 5 tokens: private copy of block 0 + one new block
    assert result.copies == ((0, 1),)
    assert result.new_block_ids == (1, 2)
    assert manager.block_ids("c") == [1, 2]
    assert manager.refcount(0) == 1


def test_copy_on_write_out_of_blocks_changes_nothing():
    manager = KVBlockManager(num_blocks=1, block_size=4)
    manager.allocate("p", 2)
    manager.fork("p", "c")
    assert not manager.can_append("c", 1)
    with pytest.raises(OutOfBlocks, match="need 1, only 0 free"):
        manager.append("c", 1)
    assert manager.block_ids("c") == [0]
    assert manager.refcount(0) == 2
    assert manager.num_tokens("c") == 2


def test_free_returns_unshared_blocks():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("p", 6)
    manager.fork("p", "c")
    manager.append("c", 3)
    manager.free("p")
    assert not manager.has("p")
    assert manager.block_ids("c") == [0, 2, 3]
    assert manager.num_used_blocks == 3  # block 1 (parent's private tail) is free again
    assert manager.refcount(1) == 0
    manager.free("c")
    assert manager.num_free_blocks == 4
    assert manager.seq_ids() == []


def test_slot_ids_map_positions_to_flat_slots():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", 2)
    manager.allocate("b", 7)  # blocks 1, 2
    assert manager.slot_ids("b", 0, 7) == [4, 5, 6, 7, 8, 9, 10]
    assert manager.slot_ids("b", 3, 5) == [7, 8]
    assert manager.slot_ids("b", 7, 7) == []
    with pytest.raises(ValueError, match=r"\[5, 8\) outside sequence 'b' with 7 tokens"):
        manager.slot_ids("b", 5, 8)
    with pytest.raises(ValueError):
        manager.slot_ids("b", -1, 2)


def test_slot_runs_are_the_slot_ids_as_maximal_runs_of_consecutive_slots():
    manager = KVBlockManager(num_blocks=8, block_size=4)
    manager.allocate("a", 4)  # block 0
    manager.allocate("gap", 4)  # block 1
    manager.allocate("b", 8)  # blocks 2, 3: one run of 8 slots
    manager.free("gap")
    manager.append("b", 7)  # then the freed block 1 (a new run), then block 4 (another)
    assert manager.block_ids("b") == [2, 3, 1, 4]
    assert manager.slot_runs("b", 0, 15) == ((8, 8), (4, 4), (16, 3))
    for start in range(16):
        for end in range(start, 16):
            runs = manager.slot_runs("b", start, end)
            assert [slot for first, n in runs for slot in range(first, first + n)] == manager.slot_ids("b", start, end)
            assert all(n >= 1 for _, n in runs)
            assert all(first + n != next_first for (first, n), (next_first, _) in zip(runs, runs[1:]))
    with pytest.raises(ValueError, match=r"\[14, 16\) outside sequence 'b' with 15 tokens"):
        manager.slot_runs("b", 14, 16)
    manager.release_leading_blocks("b", 1)
    assert manager.slot_runs("b", 4, 6) == ((12, 2),)
    with pytest.raises(ValueError, match="returned to the pool"):
        manager.slot_runs("b", 3, 6)


def test_empty_sequence_then_append():
    manager = KVBlockManager(num_blocks=2, block_size=4)
    assert manager.allocate("a", 0) == []
    manager.fork("a", "b")
    assert manager.append("b", 1) == AppendResult(new_block_ids=(0,))
    assert manager.block_ids("a") == []


def test_bad_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        KVBlockManager(num_blocks=2, block_size=0)


def test_hand_over_keeps_the_leading_blocks_under_the_new_id_and_frees_the_rest():
    manager = KVBlockManager(num_blocks=8, block_size=4)
    blocks = manager.allocate("ahead", 16)
    manager.hand_over("ahead", "real", 5)
    assert not manager.has("ahead") and manager.block_ids("real") == blocks[:2]
    assert (manager.num_tokens("real"), manager.num_used_blocks) == (5, 2)
    manager.append("real", 3)  # a table like any other: it grows and frees as usual
    manager.free("real")
    assert manager.num_free_blocks == 8


def test_hand_over_refuses_without_changing_anything():
    manager = KVBlockManager(num_blocks=8, block_size=4)
    blocks = manager.allocate("ahead", 8)
    manager.allocate("taken", 4)
    with pytest.raises(ValueError):
        manager.hand_over("ahead", "taken", 4)  # the new id has a table
    with pytest.raises(ValueError):
        manager.hand_over("ahead", "real", 9)  # more tokens than the table holds
    manager.fork("ahead", "child")
    with pytest.raises(ValueError):
        manager.hand_over("ahead", "real", 4)  # its blocks are shared
    with pytest.raises(KeyError):
        manager.hand_over("nobody", "real", 4)
    assert manager.block_ids("ahead") == blocks and manager.num_tokens("ahead") == 8
