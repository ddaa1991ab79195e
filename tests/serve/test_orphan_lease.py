"""OrphanLeases over a stand-in engine loop: which stream events start, keep or
cancel a lease, and what an expired lease does. Waits are hang guards only."""

from __future__ import annotations

import asyncio

import pytest

from dualpace.errors import RequestNotFound
from dualpace.serve.orphan_lease import OrphanLeases

HANG_GUARD_S = 30.0


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1


class Metrics:
    def __init__(self) -> None:
        self.orphaned_requests = Counter()

    def request_orphaned(self) -> None:
        self.orphaned_requests.inc()


class FakeLoop:
    def __init__(self, *request_ids: str) -> None:
        self.channels = {rid: object() for rid in request_ids}
        self.metrics = Metrics()
        self.aborted: asyncio.Queue[str] = asyncio.Queue()

    async def abort(self, request_id: str) -> None:
        if request_id not in self.channels:
            raise RequestNotFound(request_id)
        del self.channels[request_id]
        await self.aborted.put(request_id)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, HANG_GUARD_S))


def test_a_request_left_running_without_a_reader_is_aborted_and_counted():
    async def scenario():
        loop = FakeLoop("a", "b")
        leases = OrphanLeases(loop, timeout_s=0.01)
        for rid in ("a", "b"):
            leases.attach(rid)
        leases.detach("a", left_running=True)
        leases.detach("b", left_running=False)  # finished (or aborted with its stream): no lease
        assert leases.leased_ids == ["a"]
        assert await loop.aborted.get() == "a"
        assert leases.num_orphaned == 1 and loop.metrics.orphaned_requests.value == 1
        assert leases.leased_ids == [] and "b" in loop.channels

    run(scenario())


def test_a_resume_within_the_lease_keeps_the_request():
    async def scenario():
        loop = FakeLoop("a", "b")
        leases = OrphanLeases(loop, timeout_s=0.05)
        leases.attach("a")
        leases.detach("a", left_running=True)
        leases.attach("a")  # the router re-attached (a Generate resume)
        assert leases.leased_ids == []
        leases.start("b")  # an import committed; its lease expiring shows that a's would have by now
        assert await loop.aborted.get() == "b"
        assert "a" in loop.channels and leases.num_orphaned == 1

    run(scenario())


def test_a_second_reader_keeps_the_request_until_the_last_one_leaves():
    async def scenario():
        loop = FakeLoop("a")
        leases = OrphanLeases(loop, timeout_s=0.01)
        leases.attach("a")
        leases.attach("a")
        leases.detach("a", left_running=True)
        assert leases.leased_ids == []
        leases.detach("a", left_running=True)
        assert leases.leased_ids == ["a"]
        assert await loop.aborted.get() == "a"

    run(scenario())


def test_a_request_gone_before_its_lease_expires_is_not_counted():
    async def scenario():
        loop = FakeLoop("a", "b")
        leases = OrphanLeases(loop, timeout_s=0.01)
        leases.start("a")
        del loop.channels["a"]  # finished or migrated away meanwhile
        leases.start("b")
        assert await loop.aborted.get() == "b"  # leases expire in order: a's has expired too
        assert leases.num_orphaned == 1

    run(scenario())


def test_a_lease_must_be_positive():
    with pytest.raises(ValueError):
        OrphanLeases(FakeLoop(), timeout_s=0)
