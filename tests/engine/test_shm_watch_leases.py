"""Write leases over the sender's watch connection (dualpace.engine.transfer.shm_watch_leases): the rules of
a lease on a connection of its own hold on the shared one, for each of several jobs at once.
(A SIGKILLed sender, whose watch ends with it: tests/reliability/test_kv_shm_kill.py.)"""

from __future__ import annotations

import asyncio
import os

import pytest

from dualpace.engine.transfer.kv_shm_import import ShmImport
from dualpace.engine.transfer.kv_shm_protocol import ShmOffer
from dualpace.engine.transfer.kv_shm_send import MappedPools
from dualpace.engine.transfer.migration import KvImporter, migrate_out
from dualpace.engine.transfer.same_host import SameHostRefused, boot_id
from dualpace.errors import Unavailable
from dualpace.sampling import SamplingParams
from tests.engine.test_migration import started, stop, wait_tokens
from tests.engine.test_migration_shm import shared_target

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux shared memory")


async def headers(tiny, num_requests: int) -> list:
    """Import headers of `num_requests` requests that ran a few steps on a source (then resumed there)."""
    source = await started(tiny, "src")
    captured = []

    async def capture(header, chunks):
        captured.append(header)
        raise Unavailable("only the header was wanted")

    for i in range(num_requests):
        channel = await source[0].add_request(f"w{i}", [5, 6, 7, 8, 9 + i], SamplingParams(max_tokens=8, ignore_eos=True))
        await wait_tokens(channel, 2)
        with pytest.raises(Unavailable):
            await migrate_out(source[0], f"w{i}", capture)
    await stop(source)
    return captured


async def reserved(target, pool, header):
    importer = KvImporter(target)
    shm = ShmImport(pool, importer)
    await importer.begin(header)
    answer = shm.answer(ShmOffer(boot_id()))
    assert answer.lease_on_watch
    return importer, shm, answer


async def still_waiting(task: asyncio.Task) -> bool:
    for _ in range(20):
        await asyncio.sleep(0)
    return not task.done()


async def cancel_import(importer, shm) -> None:
    await shm.close()
    await importer.cancel()


async def test_blocks_wait_for_the_lease_and_a_revoked_job_gets_none(tiny):
    target, pool = await shared_target(tiny, "dst")
    (header,) = await headers(tiny, 1)
    importer, shm, answer = await reserved(target[0], pool, header)
    mapped = MappedPools()
    async with mapped.using(answer):
        async with mapped.lease(answer):
            closing = asyncio.create_task(cancel_import(importer, shm))
            assert await still_waiting(closing)  # the import is cancelled, but a copy may still write
            assert target[0].load().kv_blocks_used > 0
        await closing  # the lease's end went over the watch: the blocks are free now
        assert target[0].load().kv_blocks_used == 0
        with pytest.raises(SameHostRefused):
            async with mapped.lease(answer):
                pass
    assert mapped.num_mapped == 1  # the watch stays for the next transfer
    mapped.close()
    await pool.close()
    await stop(target)


async def test_leases_of_several_jobs_share_one_watch_and_end_apart(tiny):
    target, pool = await shared_target(tiny, "dst")
    first, second = [await reserved(target[0], pool, header) for header in await headers(tiny, 2)]
    mapped = MappedPools()
    async with mapped.using(first[2]), mapped.using(second[2]):
        async with mapped.lease(first[2]):
            async with mapped.lease(second[2]):
                closing_first = asyncio.create_task(cancel_import(*first[:2]))
                closing_second = asyncio.create_task(cancel_import(*second[:2]))
                assert await still_waiting(closing_first) and await still_waiting(closing_second)
            await closing_second  # that job's lease ended; the other one is still held
            assert await still_waiting(closing_first)
        await closing_first
    assert mapped.num_mapped == 1 and target[0].load().kv_blocks_used == 0
    mapped.close()
    await pool.close()
    await stop(target)


async def test_a_dropped_mapping_keeps_its_watch_until_the_copy_ends(tiny):
    """Dropping the mapping (this engine shutting down) must not end a lease a copy still holds:
    the watch closes only after the last copy, and that close ends the lease."""
    target, pool = await shared_target(tiny, "dst")
    (header,) = await headers(tiny, 1)
    importer, shm, answer = await reserved(target[0], pool, header)
    mapped = MappedPools()
    async with mapped.using(answer):
        lease = mapped.lease(answer)
        await lease.__aenter__()
        mapped.close()
        closing = asyncio.create_task(cancel_import(importer, shm))
        assert await still_waiting(closing)
        await lease.__aexit__(None, None, None)  # the watch is closed already for new leases: no end sent
        assert await still_waiting(closing)  # the copy's mapping is still held
    await asyncio.wait_for(closing, 10)  # the last user closed the watch: the lease ended with it
    assert target[0].load().kv_blocks_used == 0
    await pool.close()
    await stop(target)

