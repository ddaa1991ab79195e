"""The router's prefix index, fed with real KV events from salted engine hashes."""

from __future__ import annotations

from dualpace.kv.events import KvEventLog
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.kv.prefix_index import PrefixIndex


def engine_log(block_size: int, salt: str, prompts: list[list[int]]) -> KvEventLog:
    """What an engine publishes after caching every full block of each prompt."""
    hasher = BlockHasher(block_size, salt)
    log = KvEventLog("gpu", block_size)
    for prompt in prompts:
        chain = hasher.chain(prompt)
        log.stored(chain, None, prompt[: len(chain) * block_size])
    return log


def test_longest_cached_prefix_per_engine_without_knowing_their_salts():
    system = list(range(100, 112))
    gpu = engine_log(4, "model|bf16", [system + [1, 2, 3, 4]])
    cpu = engine_log(2, "model|fp32", [system[:6]])
    index = PrefixIndex()
    index.apply("gpu", gpu.since(0))
    index.apply("cpu", cpu.since(0))
    request = system + [9, 9, 9]
    assert index.cached_prefix_tokens("gpu", request) == 12
    assert index.cached_prefix_tokens("cpu", request) == 6
    assert index.cached_prefix_tokens("gpu", [5] + request) == 0  # another first token: another chain
    assert index.cached_prefix_tokens("nobody", request) == 0


def test_removed_cleared_forgotten_and_rebuilt_from_a_snapshot():
    block_size = 2
    hasher = BlockHasher(block_size, "s")
    tokens = [1, 2, 3, 4, 5, 6]
    chain = hasher.chain(tokens)
    log = KvEventLog("cpu", block_size)
    log.stored(chain[:1], None, tokens[:2])
    log.stored(chain[1:], chain[0], tokens[2:])  # a later event continues the chain by its parent
    index = PrefixIndex()
    index.apply("cpu", log.since(0))
    assert index.cached_prefix_tokens("cpu", tokens) == 6
    log.removed(chain[1])
    index.apply("cpu", log.since(2))
    assert index.cached_prefix_tokens("cpu", tokens) == 2  # the run stops at the hole
    restarted = PrefixIndex()  # a restarted router subscribes again: snapshot first
    restarted.apply("cpu", log.snapshot())
    assert index.num_blocks("cpu") == 2  # the third block is still cached, though no lookup reaches it
    assert restarted.num_blocks("cpu") == 1  # its parent is not in the snapshot: not indexed at all
    assert restarted.cached_prefix_tokens("cpu", tokens) == 2
    log.all_cleared()
    index.apply("cpu", log.since(3))
    assert index.num_blocks("cpu") == 0
    restarted.forget("cpu")
    assert restarted.cached_prefix_tokens("cpu", tokens) == 0


def test_a_block_whose_parent_is_unknown_is_not_indexed():
    hasher = BlockHasher(2, "s")
    chain = hasher.chain([1, 2, 3, 4])
    log = KvEventLog("gpu", 2)
    log.stored(chain[1:], chain[0], [3, 4])
    index = PrefixIndex()
    index.apply("gpu", log.since(0))
    assert index.num_blocks("gpu") == 0
