"""The host tier in process (fp32, the tiny model): a finished request's cached blocks are
offered to the CPU engine's pool (a cache-only KV import), where they enter the prefix cache
unreferenced, with stored events of medium cpu; a conversation continued on the CPU engine
after the GPU engine evicted its history hits them and gives the outputs of a full
recompute; blocks in use return to 0; blocks made under another salt are refused."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from cpu_service.runner import CpuRunner
from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.transfer.host_tier import HostTierOffers
from dualpace.engine.transfer.host_tier_import import HostTierImporter
from dualpace.engine.loop import EngineLoop
from dualpace.errors import FailedPrecondition
from dualpace.faults import FaultConfig
from dualpace.generation import OfflineGenerator
from dualpace.kv.events import STORED
from dualpace.policy.mode_choice import AssistSetting, ModeChooser
from dualpace.sampling import SamplingParams
from tests.engine.test_migration import stop
from tests.helpers import import_over_data_socket

BLOCK_SIZE = 4
HISTORY = [7, 3, 11, 5, 2, 19, 23, 4, 9, 31, 8, 6, 14, 27, 1, 12, 40, 41, 13, 17, 29]  # 21 tokens


def cache_only_send(target: EngineLoop, salt: str | None = None):
    """The transport of an offer, into the target's host-tier importer (as ImportKv makes it) over its
    data socket; salt: the header claims that prefix-cache salt instead of the source's."""

    async def send(header, outgoing_from) -> tuple[str, int]:
        if salt is not None:
            header = replace(header, cache_salt=salt)
        importer = HostTierImporter(target)
        return await import_over_data_socket(importer, header, outgoing_from), importer.num_held_tokens

    return send


async def started(tiny, kind: str, num_blocks: int) -> tuple[EngineLoop, asyncio.Task]:
    config = EngineConfig(name=kind, kind=kind, num_kv_blocks=num_blocks, block_size=BLOCK_SIZE)
    runner = None
    if kind == "cpu":
        runner = CpuRunner(tiny, num_blocks, BLOCK_SIZE, ModeChooser(AssistSetting.NEVER, assist_configured=False))
    loop = EngineLoop(EngineCore(tiny, config, runner))
    return loop, asyncio.create_task(loop.run())


async def generate(loop: EngineLoop, request_id: str, prompt: list[int], params: SamplingParams):
    channel = await loop.add_request(request_id, prompt, params)
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]
    return tokens, channel.num_cached_tokens


async def test_a_conversation_continues_on_the_cpu_engine_from_the_host_tier(tiny):
    gpu, cpu = await started(tiny, "gpu", 12), await started(tiny, "cpu", 64)
    offers = HostTierOffers(gpu[0], cache_only_send(cpu[0]))
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        reference = OfflineGenerator(tiny)
        first, _ = await generate(gpu[0], "turn-1", HISTORY, params)
        turn1_tokens = HISTORY + first  # 29 tokens, the last one not computed: 7 full blocks
        # The offer is queued by the finish; send it here (run() would do it in the background).
        assert await offers.offer(offers._pending.popleft()) == 7
        assert offers.counts.num_offers == 1 and not offers._pending
        cpu_events = cpu[0].core.scheduler.prefix_cache.events
        stored = [e for e in cpu_events.since(0) if e.kind == STORED]
        assert sum(len(e.block_hashes) for e in stored) == 7 and {e.medium for e in stored} == {"cpu"}
        assert cpu[0].load().kv_blocks_used == 0 and cpu[0].load().kv_blocks_cached == 7

        # Another request fills the GPU engine's pool: turn 1's blocks are evicted there.
        filler = [50 + i for i in range(44)]  # 12 blocks: the whole pool
        await generate(gpu[0], "filler", filler, SamplingParams(max_tokens=2, ignore_eos=True))
        gpu_blocks = gpu[0].core.scheduler.blocks
        assert gpu_blocks.match_prefix(gpu[0].core.scheduler.prefix_cache.hasher.chain(turn1_tokens)) == []

        turn2 = turn1_tokens + [60, 61, 62, 63, 64]
        tokens, num_cached = await generate(cpu[0], "turn-2", turn2, params)
        assert num_cached == 28  # the history's 7 blocks, from the host tier: only 6 tokens prefilled
        assert tokens == reference.generate([turn2], [params])[0].output_token_ids
        assert gpu[0].load().kv_blocks_used == 0 and cpu[0].load().kv_blocks_used == 0

        # The same chain again is not sent twice; one the GPU engine no longer caches has nothing to send.
        assert await offers.offer(tuple(turn1_tokens[:28])) == 0
        assert offers.counts.num_skipped == 1
    finally:
        await stop(gpu, cpu)


async def test_blocks_made_under_another_salt_are_refused(tiny):
    gpu, cpu = await started(tiny, "gpu", 16), await started(tiny, "cpu", 16)
    offers = HostTierOffers(gpu[0], cache_only_send(cpu[0], salt="other-model|int8"))
    try:
        await generate(gpu[0], "a", HISTORY, SamplingParams(max_tokens=4, ignore_eos=True))
        assert await offers.offer(offers._pending.popleft()) == 0
        assert offers.counts.num_failed == 1 and "other-model|int8" in offers.counts.last_error
        assert cpu[0].load().kv_blocks_cached == 0 and cpu[0].load().kv_blocks_used == 0
        assert gpu[0].load().kv_blocks_used == 0  # the pin was released
    finally:
        await stop(gpu, cpu)


async def test_the_host_tier_needs_prefix_caching(tiny):
    config = EngineConfig(name="gpu", num_kv_blocks=8, block_size=BLOCK_SIZE, prefix_caching=False)
    loop = EngineLoop(EngineCore(tiny, config))
    with pytest.raises(FailedPrecondition, match="prefix-caching"):
        HostTierOffers(loop, cache_only_send(loop))
    loop.close()


async def test_an_offer_sends_only_the_blocks_the_host_tier_lacks(tiny):
    gpu, cpu = await started(tiny, "gpu", 32), await started(tiny, "cpu", 64)
    offers = HostTierOffers(gpu[0], cache_only_send(cpu[0]))
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        await generate(gpu[0], "turn-1", HISTORY, params)
        assert await offers.offer(offers._pending.popleft()) == 7 and offers.counts.num_sent_tokens == 28
        # Turn 2 extends the chain: its offer reaches 11 blocks, of which the host tier holds 7.
        history = HISTORY + (await generate(gpu[0], "turn-1b", HISTORY, params))[0]
        turn2 = history + [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74]
        await generate(gpu[0], "turn-2", turn2, params)
        offers._pending.clear()
        assert await offers.offer(tuple(turn2[:44])) == 11
        assert offers.counts.num_sent_tokens == 28 + 16  # only the 4 blocks the CPU engine lacked
        assert cpu[0].load().kv_blocks_cached == 11 and cpu[0].load().kv_blocks_used == 0
        # The CPU engine continues from the combined chain exactly as a recompute.
        turn3 = turn2[:44] + [90, 91, 92]
        tokens, num_cached = await generate(cpu[0], "turn-3", turn3, params)
        assert num_cached == 44
        assert tokens == OfflineGenerator(tiny).generate([turn3], [params])[0].output_token_ids
        assert gpu[0].load().kv_blocks_used == 0 and cpu[0].load().kv_blocks_used == 0
    finally:
        await stop(gpu, cpu)


async def test_an_import_ended_before_its_commit_leaves_the_held_blocks_cached_and_none_used(tiny):
    gpu, cpu = await started(tiny, "gpu", 32), await started(tiny, "cpu", 32)
    offers = HostTierOffers(gpu[0], cache_only_send(cpu[0]))
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        first, _ = await generate(gpu[0], "turn-1", HISTORY, params)
        assert await offers.offer(offers._pending.popleft()) == 7
        turn2 = HISTORY + first + list(range(60, 75))  # 44 tokens: 11 blocks, 7 of them on the CPU engine
        await generate(gpu[0], "turn-2", turn2, params)
        offers._pending.clear()

        async def cut_after_first_layer(header, outgoing_from):
            importer = HostTierImporter(cpu[0])
            sent_from = []

            async def check_reserved(phase: str) -> None:
                if phase == "reserved":
                    assert importer.num_held_tokens == 28  # the 7 held blocks, taken into the import's table
                    assert cpu[0].load().kv_blocks_used == 11

            def outgoing_after_held(first_token: int):
                sent_from.append(first_token)
                return outgoing_from(first_token)

            try:
                return await import_over_data_socket(importer, header, outgoing_after_held,
                                                     FaultConfig(kv_cut_after_layers=1), check_reserved), 0
            finally:
                assert sent_from == [28]  # only the tokens after the held ones were sent

        offers.send = cut_after_first_layer
        assert await offers.offer(tuple(turn2[:44])) == 0
        assert offers.counts.num_failed == 1 and "cut after 1 layers" in offers.counts.last_error
        assert cpu[0].load().kv_blocks_used == 0 and cpu[0].load().kv_blocks_cached == 7
        assert gpu[0].load().kv_blocks_used == 0
    finally:
        await stop(gpu, cpu)
