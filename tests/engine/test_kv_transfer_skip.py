"""A cache-only import that skips the tokens the target holds (skip_cached): the chunks start
at the held token, and completeness is every layer's coverage to the end plus the bytes of
the tokens after the held ones."""

from __future__ import annotations

import pytest

from dualpace.engine.transfer.kv_transfer import ImportProgress, KvChunk, KvLayout, KvTransferHeader, checksum, plan_chunks
from dualpace.errors import InvalidArgument
from dualpace.sampling_params import SamplingParams

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype="float32")


def header(num_tokens: int = 12) -> KvTransferHeader:
    return KvTransferHeader("c", tuple(range(num_tokens)), (), SamplingParams(max_tokens=1, seed=0), num_tokens, LAYOUT,
                            total_chunks=len(plan_chunks(num_tokens, LAYOUT, 32)),
                            total_bytes=2 * 2 * num_tokens * LAYOUT.bytes_per_token_per_layer, source_engine="gpu",
                            cache_only=True, skip_cached=True)


def chunk(seq: int, layer: int, start: int, end: int) -> KvChunk:
    k = v = bytes(8 * (end - start))
    return KvChunk(seq, layer, start, end, k, v, checksum(k, v))


def test_only_the_tokens_after_the_held_ones_are_expected():
    progress = ImportProgress(header())
    progress.skip_held(8)
    plan = plan_chunks(12, LAYOUT, 32, first_token=8)
    assert plan == [(0, 8, 10), (0, 10, 12), (1, 8, 10), (1, 10, 12)]  # 32 bytes: 2 tokens a chunk
    with pytest.raises(InvalidArgument, match="start at 8"):
        progress.check_order(chunk(0, 0, 0, 2))  # a chunk of a held token
    for seq, (layer, start, end) in enumerate(plan[:3]):
        progress.check_chunk(chunk(seq, layer, start, end))
        progress.accept(chunk(seq, layer, start, end))
    with pytest.raises(InvalidArgument, match="layer 1 has 10 of 12"):
        progress.check_complete()
    progress.check_chunk(chunk(3, 1, 10, 12))
    progress.accept(chunk(3, 1, 10, 12))
    progress.check_complete()
    assert progress.num_bytes == 4 * 2 * 8 * 2


def test_all_held_needs_no_chunk_and_a_bad_count_is_refused():
    progress = ImportProgress(header())
    progress.skip_held(12)
    progress.check_complete()
    with pytest.raises(InvalidArgument, match="num_held_tokens"):
        ImportProgress(header()).skip_held(13)
