"""A MigrateOut whose caller goes away still runs its migration to the end.

The soak found it: its second router, SIGKILLed right after its requests' first tokens (the
moment the GPU engine hands them off to the CPU engine), cancelled a MigrateOut between two of
the migration's steps; the request stayed paused on the source, holding its KV blocks, listed
but neither running nor waiting, and the engine could not drain on SIGTERM. Order, not time:
the migration below waits for an event the test sets only after the RPC was cancelled."""

from __future__ import annotations

import asyncio

import pytest

from dualpace.engine.migration import MigrationStats
from dualpace.serve import engine_servicer
from dualpace.wire.v1 import engine_pb2

HANG_GUARD_S = 60.0


async def test_a_cancelled_migrate_out_still_runs_the_migration_to_its_end(monkeypatch):
    started, proceed, ended = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def migration(loop, request_id, sender, migrated_to=None):
        started.set()
        await proceed.wait()  # e.g. the step boundary that pauses the request
        ended.set()  # ... and on to the commit and the release
        return MigrationStats("cpu", 1, 0, 0.0)

    monkeypatch.setattr(engine_servicer, "migrate_out", migration)
    servicer = engine_servicer.EngineServicer.__new__(engine_servicer.EngineServicer)
    servicer.loop, servicer.faults, servicer.auth_token = None, None, None
    rpc = asyncio.create_task(servicer.MigrateOut(
        engine_pb2.MigrateOutRequest(request_id="r", target_address="127.0.0.1:1"), None))
    await asyncio.wait_for(started.wait(), HANG_GUARD_S)
    rpc.cancel()  # the caller is gone
    with pytest.raises(asyncio.CancelledError):
        await rpc
    assert not ended.is_set()
    proceed.set()
    await asyncio.wait_for(ended.wait(), HANG_GUARD_S)
