"""The node's KV view for Dynamo (both engines' events -> one worker's stored/removed) and the
relay that follows each engine's stream, without Dynamo or real engines (the last test: the worker's flag check)."""

from __future__ import annotations

import asyncio

import pytest

from dualpace.errors import InvalidArgument
from dualpace.kv.events import ALL_CLEARED, REMOVED, STORED, KvEvent
from dualpace.kv.prefix_hash import BlockHasher
from dynamo_worker.engine_client import EngineStreamError
from dynamo_worker.kv_events import NodeKvView
from dynamo_worker.kv_relay import KvRelay
from tests.helpers import until

BLOCK = 4
TOKENS = list(range(100, 112))  # three blocks of 4


def stored(salt: str, token_ids, first_block: int = 0, block_size: int = BLOCK, event_id: int = 1) -> KvEvent:
    """The stored event an engine with hash salt `salt` sends for blocks first_block.. of token_ids."""
    hashes = BlockHasher(block_size, salt).chain(token_ids)
    parent = hashes[first_block - 1] if first_block else None
    return KvEvent(event_id, STORED, tuple(hashes[first_block:]), parent,
                   tuple(token_ids[first_block * block_size:]), block_size, "gpu")


def removed(salt: str, token_ids, index: int) -> KvEvent:
    return KvEvent(2, REMOVED, (BlockHasher(BLOCK, salt).chain(token_ids)[index],), medium="gpu")


def test_a_chain_is_published_with_dynamo_ids_tokens_and_parents():
    view = NodeKvView(BLOCK)
    [first] = view.apply("gpu", [stored("gpu-salt", TOKENS[:8])])
    assert first["type"] == "stored" and first["token_ids"] == TOKENS[:8] and first["num_block_tokens"] == [4, 4]
    assert first["parent_hash"] is None and len(set(first["block_hashes"])) == 2
    assert all(-2**63 <= h < 2**63 for h in first["block_hashes"])
    [child] = view.apply("gpu", [stored("gpu-salt", TOKENS, first_block=2)])
    assert child["parent_hash"] == first["block_hashes"][-1] and child["token_ids"] == TOKENS[8:]
    assert view.num_blocks == 3


def test_the_same_prefix_on_both_engines_is_one_set_of_blocks_until_both_drop_it():
    view = NodeKvView(BLOCK)
    [on_gpu] = view.apply("gpu", [stored("gpu-salt", TOKENS)])
    assert view.apply("cpu", [stored("cpu-salt", TOKENS)]) == []  # other salt, same content: known already
    assert view.apply("gpu", [removed("gpu-salt", TOKENS, 2)]) == []  # the CPU engine still holds it
    assert view.apply("cpu", [removed("cpu-salt", TOKENS, 2)]) == [
        {"type": "removed", "block_hashes": [on_gpu["block_hashes"][2]]}]


def test_a_run_new_to_the_node_hangs_under_the_block_another_engine_holds():
    view = NodeKvView(BLOCK)
    [gpu] = view.apply("gpu", [stored("gpu-salt", TOKENS[:4])])
    [cpu] = view.apply("cpu", [stored("cpu-salt", TOKENS)])
    assert cpu["parent_hash"] == gpu["block_hashes"][0] and cpu["token_ids"] == TOKENS[4:]


def test_all_cleared_or_a_lost_stream_withdraws_only_that_engines_own_blocks():
    view = NodeKvView(BLOCK)
    [shared] = view.apply("gpu", [stored("gpu-salt", TOKENS[:4])])
    view.apply("cpu", [stored("cpu-salt", TOKENS[:4])])
    [own] = view.apply("gpu", [stored("gpu-salt", [7] * 8)])
    [gone] = view.apply("gpu", [KvEvent(3, ALL_CLEARED, medium="gpu")])
    assert sorted(gone["block_hashes"]) == sorted(own["block_hashes"])
    assert [e["block_hashes"] for e in view.clear("cpu")] == [shared["block_hashes"]]
    assert view.num_blocks == 0 and view.clear("cpu") == []


def test_larger_engine_blocks_are_split_and_others_skipped():
    view = NodeKvView(BLOCK)
    [split] = view.apply("cpu", [stored("cpu-salt", TOKENS[:8], block_size=8)])
    assert split["num_block_tokens"] == [4, 4]
    assert view.apply("gpu", [stored("gpu-salt", TOKENS[:8])]) == []  # the same content in blocks of 4: known
    assert NodeKvView(BLOCK).apply("gpu", [stored("s", TOKENS[:8], block_size=8)])[0]["block_hashes"] == \
        split["block_hashes"]  # the ids depend on content only
    odd = NodeKvView(BLOCK)
    assert odd.apply("cpu", [stored("cpu-salt", TOKENS[:6], block_size=6)]) == [] and odd.num_skipped_blocks == 1


def test_a_block_whose_parent_left_the_engine_is_skipped():
    view = NodeKvView(BLOCK)
    assert view.apply("gpu", [stored("gpu-salt", TOKENS, first_block=1)]) == []
    assert view.num_skipped_blocks == 2 and view.num_blocks == 0


class FakeEngine:
    """Serves a snapshot, then fails (the engine is killed); the next watch gets a fresh snapshot."""

    def __init__(self):
        self.address = "unix:/engine.sock"
        self.num_watches = 0
        self.closed = False

    async def watch_kv_events(self):
        self.num_watches += 1
        yield [KvEvent(1, ALL_CLEARED, medium="gpu")]
        if self.num_watches == 1:
            yield [stored("gpu-salt", TOKENS)]
            raise EngineStreamError("UNAVAILABLE", "engine killed")
        await asyncio.sleep(3600)  # the restarted engine: empty cache, stream open

    async def close(self):
        self.closed = True


def test_the_relay_publishes_withdraws_on_a_lost_stream_reconnects_and_stops_on_close():
    published: list[list[dict]] = []
    engine = FakeEngine()

    async def scenario():
        relay = KvRelay(NodeKvView(BLOCK), published.append, [engine])
        relay.start()
        await until(lambda: engine.num_watches >= 2, "the relay reconnects after the lost stream", 10.0)
        await relay.close()
        return relay

    relay = asyncio.run(scenario())
    assert engine.num_watches == 2 and engine.closed and relay.num_resyncs == 1
    kinds = [[e["type"] for e in batch] for batch in published]
    assert kinds == [["stored"], ["removed"]]
    assert published[1][0]["block_hashes"] == published[0][0]["block_hashes"]


def test_an_engine_without_prefix_caching_is_not_asked_again():
    class Off(FakeEngine):
        async def watch_kv_events(self):
            self.num_watches += 1
            raise EngineStreamError("FAILED_PRECONDITION", "prefix caching is off")
            yield

    engine = Off()

    async def scenario():
        relay = KvRelay(NodeKvView(BLOCK), lambda events: None, [engine])
        relay.start()
        await until(lambda: relay.num_following == 0, "the relay gives up an engine that publishes no events")
        await relay.close()

    asyncio.run(scenario())
    assert engine.num_watches == 1


def test_a_bad_engine_address_is_a_clear_error(tmp_path):
    pytest.importorskip("dynamo.common.backend", reason="NVIDIA Dynamo (the [dynamo] extra) is not installed")
    from dynamo_worker.engine import DualPaceEngine

    with pytest.raises(InvalidArgument, match="--engine.*'nowhere' is not HOST:PORT or unix:PATH"):
        asyncio.run(DualPaceEngine.from_args(["--router", "127.0.0.1:1", "--model-path", str(tmp_path),
                                              "--engine", "nowhere"]))
