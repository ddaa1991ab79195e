"""Write leases asked for ahead of their job (dualpace.engine.transfer.same_host KIND_ASK, WatchLeases.ask):
the owner holds the ask until a job opens under the sender's ticket and grants it then; a job
revoked first is refused; an ask withdrawn, or whose connection ended, grants nothing later, and
the blocks of a job still wait for a granted lease's end. (Over a whole transfer, with the
cancel and close cases: tests/serve/test_kv_shm_control.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from dualpace.engine.transfer.kv_shm_import import ShmImport
from dualpace.engine.transfer.kv_shm_protocol import ShmOffer
from dualpace.engine.transfer.kv_shm_send import MappedPools
from dualpace.engine.transfer.migration import KvImporter
from dualpace.engine.transfer.same_host import SameHostRefused, boot_id, new_ticket
from tests.engine.test_migration import stop
from tests.engine.test_migration_shm import shared_target
from tests.engine.test_shm_watch_leases import cancel_import, headers, still_waiting

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux shared memory")


async def reserved(target, pool, header, ticket: bytes | None = None):
    importer = KvImporter(target)
    shm = ShmImport(pool, importer)
    await importer.begin(header)
    answer = shm.answer(ShmOffer(boot_id(), ticket))
    assert answer.asks_lease_ahead
    return importer, shm, answer


async def until(condition) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("not reached")


async def mapped_with_route(target, pool, header):
    """A mapping of the target's pool (its watch) by a first import, and a control route to it."""
    first = await reserved(target, pool, header)
    mapped = MappedPools()
    using = mapped.using(first[2])
    await using.__aenter__()
    mapped.remember_control("dst", dataclasses.replace(first[2], control_on_watch=True))
    return mapped, using, first


async def test_an_ask_ahead_is_granted_as_its_job_opens_and_blocks_wait_for_its_end(tiny):
    target, pool = await shared_target(tiny, "dst")
    first_header, header = await headers(tiny, 2)
    mapped, using, first = await mapped_with_route(target[0], pool, first_header)
    ticket = new_ticket()
    leases = mapped.ask_lease_ahead("dst", ticket)
    assert leases is not None
    await until(lambda: ticket in pool.server._asked)  # held by the owner: no job under it yet
    importer, shm, answer = await reserved(target[0], pool, header, ticket)
    assert answer.import_token == ticket and shm._lease.granted  # granted as the job opened
    await using.__aexit__(None, None, None)
    async with mapped.using(answer):
        async with mapped.lease(answer):  # takes the answer already on its way
            closing = asyncio.create_task(cancel_import(importer, shm))
            assert await still_waiting(closing)  # cancelled, but the copy may still write
            assert target[0].load().kv_blocks_used > 0
        await closing  # the lease's end went over the watch
    leases.withdraw(ticket)  # held already: nothing more is sent
    await cancel_import(*first[:2])
    assert target[0].load().kv_blocks_used == 0 and not pool.server._asked
    mapped.close()
    await pool.close()
    await stop(target)


async def test_an_ask_for_a_job_revoked_first_is_refused(tiny):
    target, pool = await shared_target(tiny, "dst")
    first_header, header = await headers(tiny, 2)
    mapped, using, first = await mapped_with_route(target[0], pool, first_header)
    ticket = new_ticket()
    importer, shm, answer = await reserved(target[0], pool, header, ticket)
    await cancel_import(importer, shm)  # no lease was granted: the blocks are free at once
    leases = mapped.ask_lease_ahead("dst", ticket)

    async def hold() -> None:
        async with leases.held(ticket):
            pass
    with pytest.raises(SameHostRefused, match="refused"):
        await asyncio.wait_for(hold(), 5)  # not held for a job that will never come
    assert not pool.server._asked
    await using.__aexit__(None, None, None)
    await cancel_import(*first[:2])
    mapped.close()
    await pool.close()
    await stop(target)


@pytest.mark.parametrize("how", ["withdrawn", "connection closed"])
async def test_an_ask_withdrawn_or_cut_off_grants_nothing_later(tiny, how):
    target, pool = await shared_target(tiny, "dst")
    first_header, header = await headers(tiny, 2)
    mapped, using, first = await mapped_with_route(target[0], pool, first_header)
    ticket = new_ticket()
    leases = mapped.ask_lease_ahead("dst", ticket)
    await until(lambda: ticket in pool.server._asked)
    await using.__aexit__(None, None, None)
    if how == "withdrawn":
        leases.withdraw(ticket)
    else:
        mapped.close()  # no copy uses the mapping: its watch closes at once
    await until(lambda: not pool.server._asked)
    importer, shm, answer = await reserved(target[0], pool, header, ticket)
    assert answer.import_token == ticket and not shm._lease.granted
    await asyncio.wait_for(cancel_import(importer, shm), 5)  # nothing to wait for: never granted
    await cancel_import(*first[:2])
    assert target[0].load().kv_blocks_used == 0
    mapped.close()
    await pool.close()
    await stop(target)
