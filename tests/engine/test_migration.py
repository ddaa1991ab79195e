"""Two-phase KV migration between two in-process engines over the KV data socket, with faults in
the transfer."""

from __future__ import annotations

import asyncio

import pytest

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.migration import migrate_out
from dualpace.errors import InvalidArgument, Unavailable
from dualpace.faults import FaultConfig
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from tests.helpers import data_socket_send

NUM_BLOCKS = 64


async def started(tiny, name: str, block_size: int = 8, step_lock=None) -> tuple[EngineLoop, asyncio.Task]:
    """A running engine loop; step_lock: held for each step (a test holds it to keep a step from ending)."""
    loop = EngineLoop(EngineCore(tiny, EngineConfig(name=name, num_kv_blocks=NUM_BLOCKS, block_size=block_size)),
                      step_lock=step_lock)
    return loop, asyncio.create_task(loop.run())


async def stop(*pairs) -> None:
    for loop, task in pairs:
        loop.stop()
        await task
        loop.close()


async def wait_tokens(channel, count: int) -> None:
    async for _ in channel.follow():
        if len(channel.output_token_ids) >= count:
            return


@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_migrated_request_continues_exactly(tiny, temperature):
    source, target = await started(tiny, "src"), await started(tiny, "dst", block_size=4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=temperature, seed=42)
    channel = await source[0].add_request("m", prompt, params)
    await wait_tokens(channel, 5)
    stats = await migrate_out(source[0], "m", data_socket_send(target[0]))
    kv = source[0].core.runner.kv
    num_tokens = len(prompt) + len(channel.output_token_ids) - 1  # the KV of all but the last token
    assert stats.target_engine == "dst"
    assert stats.total_bytes == 2 * kv.num_layers * num_tokens * kv.num_kv_heads * kv.head_dim * kv.k.element_size()
    assert channel.migrated_to == "dst"
    emitted = len(channel.output_token_ids)
    rest = [t async for update in target[0].channel("m").follow(emitted) for t in update.new_token_ids]
    expected = OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
    assert channel.output_token_ids + rest == expected
    assert target[0].channel("m").finish_reason == FinishReason.LENGTH
    assert source[0].load().kv_blocks_used == 0 and target[0].load().kv_blocks_used == 0
    await stop(source, target)


async def test_source_stopping_after_the_commit_still_reports_the_move(tiny):
    """The target has committed, then the source stops before freeing its blocks: the move
    happened (the stream says where to), so migrate_out reports it instead of failing."""
    source, target = await started(tiny, "src"), await started(tiny, "dst")
    prompt = [2, 7, 1, 8, 2, 8]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    channel = await source[0].add_request("s", prompt, params)
    await wait_tokens(channel, 3)
    send = data_socket_send(target[0])

    async def send_then_source_stops(header, outgoing) -> str:
        name = await send(header, outgoing)
        source[0].stop()  # as on SIGTERM past its grace, between the commit and the release
        return name

    stats = await migrate_out(source[0], "s", send_then_source_stops)
    assert stats.target_engine == "dst" and channel.migrated_to == "dst"
    emitted = len(channel.output_token_ids)
    rest = [t async for update in target[0].channel("s").follow(emitted) for t in update.new_token_ids]
    assert channel.output_token_ids + rest == OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
    await stop(source, target)


@pytest.mark.parametrize("faults, error, match", [
    (FaultConfig(kv_corrupt_layer=1), InvalidArgument, "checksum mismatch in layer 1"),  # one byte changed
    (FaultConfig(kv_drop_layer=1), InvalidArgument, "data socket failed"),  # a layer never sent: cut short
    (FaultConfig(kv_cut_after_layers=1), Unavailable, "cut after 1 layers"),  # the sender gives up mid-stream
])
async def test_failed_transfer_leaves_request_on_source(tiny, faults, error, match):
    source, target = await started(tiny, "src"), await started(tiny, "dst")
    prompt = [7, 7, 1, 2]
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    channel = await source[0].add_request("f", prompt, params)
    await wait_tokens(channel, 3)
    with pytest.raises(error, match=match):
        await migrate_out(source[0], "f", data_socket_send(target[0], faults))
    assert target[0].load().kv_blocks_used == 0
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]
    assert tokens == OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
    assert channel.finish_reason == FinishReason.LENGTH and channel.migrated_to is None
    assert source[0].load().kv_blocks_used == 0
    await stop(source, target)


async def test_waiting_request_moves_without_kv_and_is_recomputed(tiny):
    """A request still queued (here: behind a full pool) moves with no KV; the target prefills it."""
    source = EngineLoop(EngineCore(tiny, EngineConfig(name="src", num_kv_blocks=4, block_size=8)))
    source_task = asyncio.create_task(source.run())
    target = await started(tiny, "dst")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    blocker = await source.add_request("blocker", [1] * 8, params)  # fills the 4-block pool
    queued_prompt = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    queued = await source.add_request("queued", queued_prompt, params)
    stats = await migrate_out(source, "queued", data_socket_send(target[0]))
    assert stats.total_bytes == 0 and queued.migrated_to == "dst"
    tokens = [t async for update in target[0].channel("queued").follow() for t in update.new_token_ids]
    assert tokens == OfflineGenerator(tiny).generate([queued_prompt], [params])[0].output_token_ids
    await wait_tokens(blocker, 20)
    await stop((source, source_task), target)
