"""KV events: what the prefix cache publishes (vLLM / Dynamo field set), and the snapshot a
new watcher starts from."""

from __future__ import annotations

import pytest

from dualpace.engine.request import EngineRequest
from dualpace.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from dualpace.kv.events import ALL_CLEARED, REMOVED, STORED, KvEventLog
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.sampling import SamplingParams


def test_log_window_snapshot_and_since():
    log = KvEventLog("gpu", 2, max_events=3)
    log.stored([b"a", b"b"], None, [1, 2, 3, 4])
    log.stored([b"c"], b"b", [5, 6])
    assert [e.event_id for e in log.since(0)] == [1, 2]
    assert log.since(2) == []
    log.removed(b"b")
    log.removed(b"c")
    assert log.since(0) is None  # event 1 left the window: the watcher must take a snapshot
    assert [e.kind for e in log.since(1)] == [STORED, REMOVED, REMOVED]
    snapshot = log.snapshot()
    assert [e.kind for e in snapshot] == [ALL_CLEARED, STORED]
    assert (snapshot[1].block_hashes, snapshot[1].parent_block_hash, snapshot[1].token_ids) == ((b"a",), None, (1, 2))
    assert snapshot[1].medium == "gpu" and snapshot[1].block_size == 2
    with pytest.raises(ValueError):
        log.stored([b"d"], None, [1])


def test_scheduler_publishes_stored_runs_and_evictions():
    block_size = 2
    log = KvEventLog("cpu", block_size)
    hasher = BlockHasher(block_size, "m")
    scheduler = Scheduler(SchedulerConfig(), 4, block_size, 1024, block_hasher=hasher, kv_events=log)

    def run(request_id: str, prompt: list[int], max_tokens: int) -> None:
        scheduler.add(EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 1))
        while scheduler.has_work:
            plan = scheduler.schedule()
            scheduler.apply(plan, StepResult({s.request_id: 9 for s in plan.sequences if s.sample}))

    run("a", [1, 2, 3, 4, 5], 1)  # 5 prompt tokens computed: two full blocks in one run
    (stored,) = log.since(0)
    assert stored.kind == STORED and stored.block_hashes == tuple(hasher.chain([1, 2, 3, 4]))
    assert stored.parent_block_hash is None and stored.token_ids == (1, 2, 3, 4)
    run("b", [7, 7, 7, 7, 7, 7], 2)  # 4 blocks in all: both of a's cached blocks are evicted
    kinds = [e.kind for e in log.since(1)]
    assert kinds.count(REMOVED) == 2 and STORED in kinds
    assert {e.block_hashes[0] for e in log.since(1) if e.kind == REMOVED} == set(stored.block_hashes)
    assert log.num_live_blocks == scheduler.blocks.num_cached_blocks
