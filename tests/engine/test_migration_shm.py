"""Two-phase KV migration through shared memory, between two in-process engines.

The target's pool is a memfd segment served by its TicketServer; the sender maps it, copies
under the import's write lease and reports layer checksums, which the target checks over
what landed in its blocks. (The system tests run the same over real daemons and gRPC.)
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import torch

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.transfer.kv_bytes import tensor_bytes
from dualpace.engine.transfer.kv_shm_import import SharedKvPool, ShmImport
from dualpace.engine.transfer.kv_shm_protocol import ShmOffer, ShmReservation, ShmWritten
from dualpace.engine.transfer.kv_shm_send import MappedPools, check_geometry, write_in_place
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.migration import KvImporter, migrate_out
from dualpace.engine.runner import ModelRunner
from dualpace.engine.transfer.same_host import SameHostRefused, boot_id, fetch_fd, held_lease
from dualpace.engine.transfer.kv_checksum import kv_checksum
from dualpace.engine.transfer.kv_transfer import KvLayout
from dualpace.engine.transfer.shm_kv_copy import layer_checksums, runs_into, slot_runs
from dualpace.engine.transfer.shm_segment import MappedKvSegment, SharedKvMemory
from dualpace.errors import InvalidArgument, Unavailable
from dualpace.faults import FaultConfig
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from tests.engine.test_migration import NUM_BLOCKS, started, stop, wait_tokens

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux shared memory")


async def shared_target(tiny, name: str, block_size: int = 4):
    """A target engine whose pool is a shared segment, and that pool served on this host."""
    memory = SharedKvMemory()
    runner = ModelRunner(tiny, NUM_BLOCKS, block_size, kv_memory=memory)
    config = EngineConfig(name=name, num_kv_blocks=NUM_BLOCKS, block_size=block_size)
    loop = EngineLoop(EngineCore(tiny, config, runner))
    return (loop, asyncio.create_task(loop.run())), await SharedKvPool.start(memory)


def shm_send(target: EngineLoop, pool: SharedKvPool, mapped: MappedPools, faults: FaultConfig | None = None):
    """The servicer's steps without gRPC: reserve, answer, map, copy under the lease, verify, commit."""
    faults = faults or FaultConfig()

    async def send(header, chunks) -> str:
        importer = KvImporter(target)
        shm = ShmImport(pool, importer)
        try:
            await importer.begin(header)
            answer = shm.answer(ShmOffer(boot_id()))
            assert isinstance(answer, ShmReservation), answer
            async with mapped.using(answer) as segment:
                check_geometry(segment, header.layout, answer, header.num_computed_tokens)
                written = await write_in_place(segment, answer, chunks, faults)
            await shm.written(written)
            await importer.prepare()
            return await importer.commit()
        finally:
            await shm.close()
            await importer.cancel()

    return send


@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_migrated_request_continues_exactly(tiny, temperature):
    source = await started(tiny, "src")
    target, pool = await shared_target(tiny, "dst", block_size=4)
    mapped = MappedPools()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=temperature, seed=42)
    channel = await source[0].add_request("m", prompt, params)
    await wait_tokens(channel, 5)
    send = shm_send(target[0], pool, mapped)
    stats = await migrate_out(source[0], "m", send)
    assert stats.target_engine == "dst" and channel.migrated_to == "dst"
    emitted = len(channel.output_token_ids)
    rest = [t async for update in target[0].channel("m").follow(emitted) for t in update.new_token_ids]
    assert channel.output_token_ids + rest == OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
    assert target[0].channel("m").finish_reason == FinishReason.LENGTH
    assert source[0].load().kv_blocks_used == 0 and target[0].load().kv_blocks_used == 0
    mapped.close()
    await pool.close()
    await stop(source, target)


@pytest.mark.parametrize("fault", [FaultConfig(kv_corrupt_layer=1), FaultConfig(kv_drop_layer=0),
                                   FaultConfig(kv_cut_after_layers=1)], ids=["corrupt", "drop", "cut"])
async def test_failed_transfer_leaves_request_on_source(tiny, fault):
    source = await started(tiny, "src")
    target, pool = await shared_target(tiny, "dst")
    mapped = MappedPools()
    prompt = [7, 7, 1, 2]
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    channel = await source[0].add_request("f", prompt, params)
    await wait_tokens(channel, 3)
    with pytest.raises(InvalidArgument if fault.kv_cut_after_layers is None else Unavailable):
        await migrate_out(source[0], "f", shm_send(target[0], pool, mapped, fault))
    assert target[0].load().kv_blocks_used == 0
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]
    assert tokens == OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
    assert channel.finish_reason == FinishReason.LENGTH and channel.migrated_to is None
    assert source[0].load().kv_blocks_used == 0
    mapped.close()
    await pool.close()
    await stop(source, target)


async def test_blocks_are_freed_only_after_the_write_lease_ends(tiny):
    """A cancelled import whose sender still holds the lease keeps its blocks until the lease ends,
    and a lease is refused once the import was cancelled."""
    target, pool = await shared_target(tiny, "dst")
    source = await started(tiny, "src")
    channel = await source[0].add_request("l", [5, 6, 7, 8, 9], SamplingParams(max_tokens=20, ignore_eos=True))
    await wait_tokens(channel, 2)
    captured = {}

    async def capture(header, chunks):
        captured["header"] = header
        raise Unavailable("only the header was wanted")

    with pytest.raises(Unavailable):
        await migrate_out(source[0], "l", capture)
    importer = KvImporter(target[0])
    shm = ShmImport(pool, importer)
    await importer.begin(captured["header"])
    answer = shm.answer(ShmOffer(boot_id()))
    used = target[0].load().kv_blocks_used
    assert used > 0
    async with held_lease(answer.socket_name, answer.import_token):
        closing = asyncio.create_task(shm.close())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done()  # it waits for the lease, whatever the time
    await closing
    await importer.cancel()
    assert target[0].load().kv_blocks_used == 0
    with pytest.raises(SameHostRefused):
        async with held_lease(answer.socket_name, answer.import_token):
            pass
    await pool.close()
    await stop(source, target)


async def test_a_wrong_ticket_or_token_is_refused(tiny):
    target, pool = await shared_target(tiny, "dst")
    with pytest.raises(SameHostRefused):
        await asyncio.to_thread(fetch_fd, pool.server.name, b"x" * 16)
    fd, watch = await asyncio.to_thread(fetch_fd, pool.server.name, pool.segment_ticket)
    watch.close()
    with pytest.raises(InvalidArgument):
        MappedKvSegment.open(fd, b"y" * 16)
    assert "boot ids differ" in pool.decline_reason(ShmOffer("another-boot-id"))
    assert pool.decline_reason(ShmOffer(boot_id())) is None
    await pool.close()
    await stop(target)


async def test_the_mapping_is_dropped_when_the_owner_goes_away(tiny):
    target, pool = await shared_target(tiny, "dst")
    mapped = MappedPools()
    answer = ShmReservation(pool.server.name, pool.segment_ticket, b"\0" * 16, ())
    async with mapped.using(answer):
        assert mapped.num_mapped == 1 and mapped.num_in_use == 1
    assert mapped.num_mapped == 1 and mapped.num_in_use == 0  # kept for the next transfer
    await pool.close()  # as the owner's death would: its end of the watch connection closes
    for _ in range(1000):
        if mapped.num_mapped == 0:
            break
        await asyncio.sleep(0.005)
    assert mapped.num_mapped == 0
    await stop(target)


def test_runs_are_contiguous_on_both_sides():
    assert slot_runs([0, 1, 2, 3], [8, 9, 10, 11]) == [(0, 8, 4)]
    assert slot_runs([0, 1, 2, 3], [8, 9, 4, 5]) == [(0, 8, 2), (2, 4, 2)]
    assert slot_runs([6, 7, 16, 17], [0, 1, 2, 3]) == [(6, 0, 2), (16, 2, 2)]
    assert slot_runs([], []) == []
    with pytest.raises(ValueError):
        slot_runs([1], [])


@pytest.mark.parametrize("runs", [(), ((5, 1),), ((32, 3), (0, 2), (100, 1)), ((5, 1), (5, 1)), ((3, 1), (2, 1))])
def test_the_source_slots_pair_with_the_target_runs(runs):
    slot_ids = [start + i for start, length in runs for i in range(length)]
    source = [7, 8, 9, 20, 21, 3][:len(slot_ids)]  # runs broken on the source side too
    assert runs_into(source, runs) == slot_runs(source, slot_ids)
    with pytest.raises(ValueError):
        runs_into(source + [1], runs)


def test_a_reservation_with_slots_outside_the_pool_or_too_few_is_refused():
    geometry = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", num_blocks=4, block_size=4)
    layout = KvLayout(2, 1, 4, 4, "float32")
    segment = SimpleNamespace(geometry=geometry)
    check_geometry(segment, layout, ShmReservation("s", b"", b"", ((12, 4),)), 4)
    for runs in [((13, 4),), ((0, 3),), ((0, 5), (0, -1)), ((-1, 4),)]:
        with pytest.raises(InvalidArgument):
            check_geometry(segment, layout, ShmReservation("s", b"", b"", runs), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_checksum_is_the_crc_of_a_whole_layer(dtype):
    """The shm path's layer checksum is kv_checksum of the layer's K bytes then V bytes, in token
    order (what the data socket's sender and target compute)."""
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(2, 4, 4, 2, 8, generator=generator).to(dtype)
    v = torch.randn(2, 4, 4, 2, 8, generator=generator).to(dtype)
    slot_ids = [5, 6, 7, 12, 13, 0]
    for layer, crc in enumerate(layer_checksums(k, v, slot_ids)):
        index = torch.tensor(slot_ids)
        k_bytes = tensor_bytes(k[layer].reshape(-1, 2, 8)[index])
        v_bytes = tensor_bytes(v[layer].reshape(-1, 2, 8)[index])
        assert crc == kv_checksum(k_bytes, v_bytes)
