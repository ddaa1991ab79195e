"""Prefix cache bookkeeping: the hash chain, sharing, copy-on-write and eviction order."""

import pytest

from dualpace.kv.allocator import BlockAllocator, OutOfBlocks
from dualpace.kv.block_table import KVBlockManager
from dualpace.kv.prefix_hash import BlockHasher


def test_hash_chain_depends_on_the_whole_prefix_and_the_salt():
    hasher = BlockHasher(2, "model-a/bf16")
    chain = hasher.chain([1, 2, 3, 4, 5])
    assert len(chain) == 2  # the partial last block is not hashed
    assert chain == hasher.chain([1, 2, 3, 4])
    assert hasher.chain([9, 2, 3, 4])[1] != chain[1]  # same block tokens, different parent
    assert hasher.chain([3, 4])[0] != chain[1]
    assert BlockHasher(2, "model-a/fp32").chain([1, 2]) != hasher.chain([1, 2])
    assert chain[0] == hasher.hash_block(None, [1, 2])  # extend packs whole runs: hash_block's values
    assert chain[1] == hasher.hash_block(chain[0], [3, 4])
    extended = chain[:1]
    hasher.extend(extended, [1, 2, 3, 4, 5, 6])
    assert extended == hasher.chain([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError):
        hasher.hash_block(None, [1])


def test_freed_registered_blocks_stay_cached_and_are_shared():
    hasher = BlockHasher(2, "m")
    manager = KVBlockManager(6, 2)
    tokens = [1, 2, 3, 4, 5]
    first = manager.allocate("a", 5)
    assert manager.register_full_blocks("a", hasher.chain(tokens), 2) == [0, 1]
    assert manager.match_prefix(hasher.chain(tokens)) == first[:2]
    manager.free("a")
    assert (manager.num_used_blocks, manager.num_cached_blocks, manager.num_free_blocks) == (0, 2, 4)
    matched = manager.match_prefix(hasher.chain([1, 2, 3, 4, 7, 8]))
    assert matched == first[:2]
    manager.allocate("b", 6, matched)
    manager.allocate("c", 5, matched)
    assert manager.refcount(first[0]) == manager.refcount(first[1]) == 2
    assert (manager.num_used_blocks, manager.num_cached_blocks) == (4, 0)
    manager.free("b")
    manager.free("c")
    assert (manager.num_used_blocks, manager.num_cached_blocks) == (0, 2)


def test_a_duplicate_content_block_is_not_cached_twice():
    hasher = BlockHasher(2, "m")
    manager = KVBlockManager(4, 2)
    manager.allocate("a", 2)
    manager.allocate("b", 2)
    assert manager.register_full_blocks("a", hasher.chain([1, 2]), 1) == [0]
    assert manager.register_full_blocks("b", hasher.chain([1, 2]), 1) == []
    manager.free("b")
    manager.free("a")
    assert (manager.num_cached_blocks, manager.num_free_blocks) == (1, 3)


def test_eviction_is_lru_among_unreferenced_blocks_tail_first():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(4)
    for block_id in blocks:
        allocator.register(block_id, bytes([block_id]))
    allocator.free(blocks[:2])  # one table's blocks 0, 1: its tail (1) goes first
    allocator.free(blocks[3:])
    assert allocator.num_cached_blocks == 3
    assert allocator.allocate(1) == [blocks[1]]
    assert allocator.lookup(bytes([blocks[1]])) is None  # its content is forgotten
    assert allocator.allocate(1) == [blocks[0]]
    allocator.share([blocks[3]])  # taken back: no longer evictable
    with pytest.raises(OutOfBlocks):
        allocator.allocate(1)  # block 2 is still referenced; nothing is evicted
    assert allocator.refcount(blocks[2]) == 1 and allocator.num_evictions == 2


def test_free_blocks_are_used_before_cached_ones_are_evicted():
    allocator = BlockAllocator(3)
    cached = allocator.allocate(1)
    allocator.register(cached[0], b"x")
    allocator.free(cached)
    assert allocator.allocate(2) == [1, 2]
    assert allocator.lookup(b"x") == cached[0]
    assert allocator.allocate(1) == cached
    assert allocator.lookup(b"x") is None


def test_copy_on_write_of_a_shared_partial_block_leaves_cached_blocks_alone():
    hasher = BlockHasher(2, "m")
    manager = KVBlockManager(8, 2)
    manager.allocate("a", 3)
    manager.register_full_blocks("a", hasher.chain([1, 2, 3]), 1)
    manager.fork("a", "b")  # shares the cached full block and the partial one
    result = manager.append("b", 1)
    a_blocks, b_blocks = manager.block_ids("a"), manager.block_ids("b")
    assert result.copies == ((a_blocks[1], b_blocks[1]),)
    assert a_blocks[0] == b_blocks[0] and manager.refcount(a_blocks[0]) == 2
    assert manager.block_hash(b_blocks[1]) is None


def test_bad_cached_arguments_raise_and_change_nothing():
    manager = KVBlockManager(4, 2)
    plain = manager.allocate("a", 2)
    with pytest.raises(ValueError, match="no cached content"):
        manager.allocate("b", 4, plain)
    with pytest.raises(ValueError, match="hold more"):
        manager.allocate("b", 1, plain)
    with pytest.raises(ValueError):
        manager.register_full_blocks("a", [b"h"], 2)
    assert not manager.has("b") and manager.num_used_blocks == 1
    allocator = BlockAllocator(2)
    with pytest.raises(ValueError, match="not in use"):
        allocator.register(0, b"h")


def test_clear_cache_frees_only_unreferenced_cached_blocks():
    hasher = BlockHasher(1, "m")
    manager = KVBlockManager(4, 1)
    manager.allocate("a", 2)
    manager.register_full_blocks("a", hasher.chain([1, 2]), 2)
    manager.allocate("b", 1, manager.match_prefix(hasher.chain([1])))
    manager.free("a")
    assert manager.clear_cache() == 1
    assert (manager.num_used_blocks, manager.num_cached_blocks, manager.num_free_blocks) == (1, 0, 3)
    manager.free("b")
    assert manager.num_cached_blocks == 1  # b's block kept its content
