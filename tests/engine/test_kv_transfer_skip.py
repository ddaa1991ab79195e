"""A cache-only import that skips the tokens the target holds (skip_cached): only the KV of the
tokens after the held ones is expected, and the import is complete once that landed and was
verified (or at once, when the target holds every token)."""

from __future__ import annotations

import pytest

from dualpace.engine.transfer.kv_transfer import ImportProgress, KvLayout, KvTransferHeader
from dualpace.errors import InvalidArgument
from dualpace.sampling_params import SamplingParams

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, dtype="float32")


def header(num_tokens: int = 12) -> KvTransferHeader:
    return KvTransferHeader("c", tuple(range(num_tokens)), (), SamplingParams(max_tokens=1, seed=0), num_tokens, LAYOUT,
                            total_bytes=2 * 2 * num_tokens * LAYOUT.bytes_per_token_per_layer, source_engine="gpu",
                            cache_only=True, skip_cached=True)


def test_only_the_tokens_after_the_held_ones_are_expected():
    progress = ImportProgress(header())
    progress.skip_held(8)
    assert progress.num_expected_tokens == 4
    assert progress.header.total_bytes == 2 * 2 * 4 * 8  # K and V, 2 layers, 4 tokens of 8 bytes
    with pytest.raises(InvalidArgument, match="KV of 4 tokens has not landed"):
        progress.check_complete()
    assert progress.num_bytes == 0
    progress.accept_in_place()
    progress.check_complete()
    assert progress.num_bytes == 2 * 2 * 4 * 8


def test_all_held_needs_no_kv_and_a_bad_count_is_refused():
    progress = ImportProgress(header())
    progress.skip_held(12)
    progress.check_complete()
    with pytest.raises(InvalidArgument, match="num_held_tokens"):
        ImportProgress(header()).skip_held(13)
