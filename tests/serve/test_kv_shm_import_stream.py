"""The same-host KV import over a real ImportKv stream (an in-process EngineServicer on loopback).

Here the sender's written message carries prepare and commit (`KvShmWritten.commit`), answered
by committed alone, and the write lease goes over the watch connection the sender keeps to the
target's pool (no connection of its own per transfer). The two-phase rules must hold across
the merge: a failure after the written record was accepted but before the commit is made (the
phases the one message now spans) leaves the request running on the source and no block used on
the target, as a refused written record does (a torn layer, a write without the lease); a target
that does not take the merged message gets prepare and commit apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

import pytest

from dualpace.engine.transfer import kv_shm_send
from dualpace.engine.transfer.kv_shm_import import ShmImport
from dualpace.engine.transfer.kv_shm_send import MappedPools
from dualpace.engine.transfer.migration import migrate_out
from dualpace.engine.transfer.same_host import boot_id
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.serve.engine_servicer import EngineServicer
from dualpace.serve.kv_shm_transport import SameHostKv, SameHostKvSender
from dualpace.serve.peer_channels import PeerChannels
from dualpace.serve.server import start_server
from dualpace.wire.v1 import engine_pb2_grpc
from tests.engine.test_migration import started, stop, wait_tokens
from tests.engine.test_migration_shm import shared_target

pytestmark = pytest.mark.skipif(boot_id() is None or not hasattr(os, "memfd_create"), reason="Linux shared memory")

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def fresh_imports_only(monkeypatch):
    """These transfers reserve their blocks as they go (a module that imports this fixture too);
    transfers into blocks reserved ahead have tests of their own (test_kv_shm_reserved_ahead.py)."""
    monkeypatch.setattr(SameHostKvSender, "_reserve_next", lambda *args: None)


class Served:
    """A target engine with a shared pool behind a real gRPC server, and a source engine."""

    async def start(self, tiny) -> Served:
        self.source = await started(tiny, "src")
        self.target, pool = await shared_target(tiny, "dst")
        self.same_host = SameHostKv("auto", pool)
        servicer = EngineServicer(self.target[0], same_host=self.same_host)
        self.server = await start_server(
            "127.0.0.1:0", lambda server: engine_pb2_grpc.add_EngineServicer_to_server(servicer, server),
            ["dualpace.v1.Engine"])
        self.channels = PeerChannels()
        self.mapped = MappedPools()
        return self

    def sender(self, faults: FaultConfig | None = None) -> SameHostKvSender:
        return SameHostKvSender(self.server.address, self.mapped, {}, self.channels, faults=faults or FaultConfig())

    async def close(self) -> None:
        self.mapped.close()
        await self.channels.close()
        await self.server.stop(0)
        await self.same_host.pool.close()
        await stop(self.source, self.target)


def expected(tiny) -> list[int]:
    return OfflineGenerator(tiny).generate([PROMPT], [PARAMS])[0].output_token_ids


async def test_written_with_commit_is_one_round_trip_and_leases_go_over_the_watch(tiny, monkeypatch):
    served = await Served().start(tiny)

    async def no_separate_phases(self, call):
        raise AssertionError("prepare and commit were sent apart to a target that takes them merged")

    def no_lease_connection(*args):
        raise AssertionError("a lease connection of its own was opened to a target that leases over the watch")

    monkeypatch.setattr(SameHostKvSender, "_prepare_and_commit", no_separate_phases)
    monkeypatch.setattr(kv_shm_send, "held_lease", no_lease_connection)
    for request_id in ("m1", "m2"):  # the second transfer reuses the mapping and its watch
        channel = await served.source[0].add_request(request_id, PROMPT, PARAMS)
        await wait_tokens(channel, 4)
        sender = served.sender()
        stats = await migrate_out(served.source[0], request_id, sender, migrated_to="dst")
        assert sender.used_shm and stats.target_engine == "dst" and channel.migrated_to == "dst"
        rest = [t async for update in served.target[0].channel(request_id).follow(len(channel.output_token_ids))
                for t in update.new_token_ids]
        assert channel.output_token_ids + rest == expected(tiny)
    assert served.mapped.num_mapped == 1
    assert served.source[0].load().kv_blocks_used == 0 and served.target[0].load().kv_blocks_used == 0
    await served.close()


@pytest.mark.parametrize("failure", ["commit_refused", "corrupt"])
async def test_a_failure_inside_the_merged_phases_keeps_the_request_on_the_source(tiny, failure):
    """commit_refused: the written record accepted, then the commit failed (the phase between the two
    replies the merge removed); corrupt: the written record itself refused (a torn layer 1)."""
    served = await Served().start(tiny)
    faults = FaultConfig()
    scheduler = served.target[0].core.scheduler
    if failure == "commit_refused":
        def refuse(request):
            raise Unavailable("commit refused after the written record (test)")
        scheduler.commit_import = refuse
    else:
        faults = FaultConfig(kv_corrupt_layer=1)
    channel = await served.source[0].add_request("f", PROMPT, PARAMS)
    await wait_tokens(channel, 4)
    sender = served.sender(faults)
    with pytest.raises(Unavailable):
        await migrate_out(served.source[0], "f", sender)
    assert served.target[0].load().kv_blocks_used == 0 and "f" not in scheduler.requests
    tokens = [t async for update in channel.follow() for t in update.new_token_ids]
    assert tokens == expected(tiny)
    assert channel.finish_reason == FinishReason.LENGTH and channel.migrated_to is None
    assert served.source[0].load().kv_blocks_used == 0
    await served.close()


async def test_a_target_without_the_merged_message_gets_prepare_and_commit_apart(tiny, monkeypatch):
    served = await Served().start(tiny)
    answer = ShmImport.answer
    monkeypatch.setattr(ShmImport, "answer", lambda self, offer: _without_merge(answer(self, offer)))
    phases = []
    prepare_and_commit = SameHostKvSender._prepare_and_commit

    async def counted(self, call):
        phases.append("prepare_and_commit")
        return await prepare_and_commit(self, call)

    monkeypatch.setattr(SameHostKvSender, "_prepare_and_commit", counted)
    channel = await served.source[0].add_request("o", PROMPT, PARAMS)
    await wait_tokens(channel, 4)
    sender = served.sender()
    await migrate_out(served.source[0], "o", sender, migrated_to="dst")
    assert sender.used_shm and phases == ["prepare_and_commit"]
    rest = [t async for update in served.target[0].channel("o").follow(len(channel.output_token_ids))
            for t in update.new_token_ids]
    assert channel.output_token_ids + rest == expected(tiny)
    await served.close()


def _without_merge(answer):
    return dataclasses.replace(answer, accepts_written_with_commit=False)


async def test_a_torn_layer_is_refused_in_a_copy_split_between_the_workers(tiny, monkeypatch):
    """A copy large enough for the workers (each copies and checksums its share of the layers): a
    sender that tears layer 0 and says written for the layers before it is refused, the request
    stays on the source, no block is left on the target."""
    monkeypatch.setattr(kv_shm_send, "INLINE_MAX_BYTES", 0)
    served = await Served().start(tiny)
    try:
        channel = await served.source[0].add_request("c", PROMPT, PARAMS)
        await wait_tokens(channel, 4)
        with pytest.raises(Unavailable, match="INVALID_ARGUMENT: shm_written.layer_crc32: 0 checksums for"):
            await migrate_out(served.source[0], "c", served.sender(FaultConfig(kv_corrupt_layer=0)))
        assert [t async for update in channel.follow() for t in update.new_token_ids] == expected(tiny)
        assert channel.migrated_to is None and served.source[0].load().kv_blocks_used == 0
        assert served.target[0].load().kv_blocks_used == 0 and "c" not in served.target[0].core.scheduler.requests
    finally:
        await served.close()


async def test_written_from_a_sender_that_never_held_the_lease_is_refused(tiny, monkeypatch):
    """A sender that says written without having taken the import's write lease (so it never wrote
    under the rules) is refused; the request stays on the source, no block is left on the target."""
    served = await Served().start(tiny)

    @contextlib.asynccontextmanager
    async def no_lease(self, reservation):
        yield

    monkeypatch.setattr(MappedPools, "lease", no_lease)
    try:
        channel = await served.source[0].add_request("n", PROMPT, PARAMS)
        await wait_tokens(channel, 4)
        with pytest.raises(Unavailable, match="INVALID_ARGUMENT: shm_written: the sender never held"):
            await migrate_out(served.source[0], "n", served.sender())
        assert [t async for update in channel.follow() for t in update.new_token_ids] == expected(tiny)
        assert channel.migrated_to is None and served.source[0].load().kv_blocks_used == 0
        assert served.target[0].load().kv_blocks_used == 0 and "n" not in served.target[0].core.scheduler.requests
    finally:
        await served.close()
