"""WatchKvEvents on a real gpu_service: the snapshot, stored events with the vLLM / Dynamo field
set as blocks fill, a second watcher (a restarted router) rebuilding the same set and the
router's prefix index from it, and FAILED_PRECONDITION with caching off."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from toolkit.engine_client import EngineClient, read_until
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.kv.prefix_index import PrefixIndex
from dualpace.sampling import SamplingParams
from dualpace.wire.kv_events import kv_event_from_pb
from dualpace.wire.v1 import engine_pb2
from router.engines import EngineHandle
from router.kv_index_watch import follow_kv_events
from toolkit.processes import start_daemon

FLAGS = ("--dtype", "fp32", "--threads", "1", "--block-size", "4", "--kv-blocks", "32")


def events_of(batch) -> list:
    return [kv_event_from_pb(e) for e in batch.events]


def cached_hashes(events, known: set | None = None) -> set:
    known = set() if known is None else set(known)
    for event in events:
        if event.kind == "all_cleared":
            known.clear()
        elif event.kind == "stored":
            known |= set(event.block_hashes)
        else:
            known -= set(event.block_hashes)
    return known


async def router_index_of(address: str) -> PrefixIndex:
    """What router.kv_index_watch builds from one engine, once its snapshot has arrived."""
    index = PrefixIndex()
    handle = EngineHandle(address, "gpu")  # the router's typed handle, as router.engines builds it
    try:
        task = asyncio.create_task(follow_kv_events(handle, index))
        async with asyncio.timeout(30):
            while index.num_blocks("gpu") == 0:
                await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await handle.close()
    return index


def test_kv_events_follow_the_prefix_cache(model_folder):
    daemon = start_daemon("gpu_service", "--model", model_folder, *FLAGS)
    client = EngineClient(daemon.address)
    try:
        watch = client.stub.WatchKvEvents(engine_pb2.WatchKvEventsRequest(), timeout=60)
        first = next(watch)
        assert [e.kind for e in events_of(first)] == ["all_cleared"] and first.engine == "gpu"  # warm-up dropped
        prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
        tokens: list[int] = []
        read_until(client.stream("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True)), tokens)
        num_cached = client.wait_idle().kv_blocks_cached
        assert num_cached == 3  # 12 tokens computed: 10 prompt and 2 of the 3 generated
        events = []
        while len(cached_hashes(events)) < num_cached:  # bounded by the stream's timeout
            events += events_of(next(watch))
        stored = [e for e in events if e.kind == "stored"]
        assert stored[0].token_ids == tuple(prompt[:8]) and stored[0].parent_block_hash is None
        assert stored[0].block_size == 4 and stored[0].medium == "gpu" and len(stored[0].block_hashes) == 2
        assert stored[1].parent_block_hash == stored[0].block_hashes[1]
        assert stored[1].token_ids == (*prompt[8:], *tokens[:2])
        assert not set(BlockHasher(4, "another model").chain(prompt)) & set(stored[0].block_hashes)  # salted
        watch.cancel()
        # A new watcher (e.g. a restarted router) starts from a snapshot of what is cached now.
        again = events_of(next(client.stub.WatchKvEvents(engine_pb2.WatchKvEventsRequest(), timeout=60)))
        assert cached_hashes(again) == cached_hashes(events)
        snapshot_parents = {e.block_hashes[0]: e.parent_block_hash for e in again if e.kind == "stored"}
        assert snapshot_parents[stored[0].block_hashes[1]] == stored[0].block_hashes[0]
        # The router's index, built by a fresh subscription: the engine holds the prompt's blocks.
        index = asyncio.run(router_index_of(daemon.address))
        assert index.cached_prefix_tokens("gpu", prompt + tokens) == 12
        assert index.cached_prefix_tokens("gpu", [99] + prompt) == 0
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_kv_events_need_prefix_caching(model_folder):
    daemon = start_daemon("gpu_service", "--model", model_folder, *FLAGS, "--prefix-caching", "off")
    try:
        with pytest.raises(grpc.RpcError) as raised:
            next(EngineClient(daemon.address).stub.WatchKvEvents(engine_pb2.WatchKvEventsRequest(), timeout=30))
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "prefix-caching off" in raised.value.details()
    finally:
        assert daemon.stop() == 0, daemon.log()
