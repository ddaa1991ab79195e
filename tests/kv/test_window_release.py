"""Sliding-window block release in the pure block tables: leading blocks go back to the pool, the
table keeps its indexing (FREED_BLOCK_ID entries), and a cached prefix is matched by the blocks
the next query's window reaches (KVBlockManager.match_prefix_in_window)."""

from __future__ import annotations

import pytest

from dualpace.kv.block_table import FREED_BLOCK_ID, KVBlockManager, readable_block_ids


def hashes(count: int) -> list[bytes]:
    return [bytes([i + 1]) * 8 for i in range(count)]


def test_released_blocks_return_to_the_pool_and_keep_the_table_indexed():
    blocks = KVBlockManager(num_blocks=8, block_size=4)
    table = blocks.allocate("a", 22)  # 6 blocks
    assert blocks.release_leading_blocks("a", 3) == 3
    assert blocks.num_used_blocks == 3 and blocks.num_free_blocks == 5
    assert blocks.block_ids("a") == [FREED_BLOCK_ID] * 3 + table[3:]
    assert blocks.num_released_tokens("a") == 12 and blocks.num_held_blocks("a") == 3
    assert blocks.release_leading_blocks("a", 2) == 0  # already released
    assert blocks.release_leading_blocks("a", 99) == 2  # never the last block
    assert blocks.block_ids("a")[-1] == table[-1] and blocks.num_used_blocks == 1
    assert blocks.slot_ids("a", 20, 22) == [table[5] * 4, table[5] * 4 + 1]
    with pytest.raises(ValueError, match="returned to the pool"):
        blocks.slot_ids("a", 19, 21)
    assert readable_block_ids(blocks.block_ids("a")) == [table[5]] * 6
    blocks.append("a", 3)  # grows past the last block as before
    assert blocks.num_used_blocks == 2
    blocks.fork("a", "b")
    assert blocks.block_ids("b") == blocks.block_ids("a") and blocks.refcount(table[5]) == 2
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_used_blocks == 0 and blocks.num_free_blocks == 8


def test_a_released_block_with_cached_content_stays_cached():
    blocks = KVBlockManager(num_blocks=8, block_size=4)
    blocks.allocate("a", 16)
    blocks.register_full_blocks("a", hashes(4), 4)
    blocks.release_leading_blocks("a", 2)
    assert blocks.num_cached_blocks == 2 and blocks.num_used_blocks == 2
    assert blocks.match_prefix(hashes(4)) != []  # still in the pool until evicted


def test_window_match_needs_only_the_blocks_the_window_reaches():
    """A finished 6-block sequence whose first two blocks were released (and so evicted first):
    the plain match finds nothing, the window's match serves as much as its window allows."""
    blocks = KVBlockManager(num_blocks=6, block_size=4)
    table = blocks.allocate("a", 24)
    blocks.register_full_blocks("a", hashes(6), 6)
    blocks.release_leading_blocks("a", 2)
    blocks.free("a")
    blocks.allocate("other", 8)  # evicts the two least recently freed: the released ones

    assert blocks.match_prefix(hashes(5)) == []
    # a hit of 5 blocks (20 tokens) with a window of 8: the next query sees positions 13..20, blocks 3 and 4
    match = blocks.match_prefix_in_window(hashes(5), window_tokens=8)
    assert match == [FREED_BLOCK_ID] * 3 + table[3:5]
    # a window of 16 reaches back into block 1, which is gone, at every hit length
    assert blocks.match_prefix_in_window(hashes(5), window_tokens=16) == []
    assert blocks.num_blocks_to_take(22, match) == 2 + 1  # the two cached ones taken back, one new
    new_table = blocks.allocate("b", 22, match)
    assert new_table[:3] == [FREED_BLOCK_ID] * 3 and new_table[3:5] == table[3:5]
    assert blocks.num_released_tokens("b") == 12 and blocks.num_used_blocks == 2 + 3
    blocks.free("b")
    blocks.free("other")
    assert blocks.num_used_blocks == 0


def test_only_leading_entries_may_be_released_in_a_new_table():
    blocks = KVBlockManager(num_blocks=4, block_size=4)
    blocks.allocate("a", 8)
    blocks.register_full_blocks("a", hashes(2), 2)
    cached = blocks.block_ids("a")
    with pytest.raises(ValueError, match="no cached content"):
        blocks.allocate("b", 12, [cached[0], FREED_BLOCK_ID])
