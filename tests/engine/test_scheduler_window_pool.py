"""The pure scheduler with a pool of the sliding layers' own (a model mixing sliding and global layers,
Gemma 3): each request holds a table in both pools, the plan carries the sliding one beside the global
one, only the sliding pool releases what the window has passed, either pool running out preempts, and a
cached prefix serves when both pools can supply it.
Driven by the checking fake model of tests/engine/scheduler_driver.py. No torch, no weights."""

from __future__ import annotations

import pytest

from dualpace.engine.request import EngineRequest
from dualpace.engine.scheduler import Scheduler, SchedulerConfig
from dualpace.engine.step_plan import StepResult
from dualpace.engine.sliding_window import split_kv_blocks
from dualpace.errors import InvalidArgument
from dualpace.kv.block_table import FREED_BLOCK_ID
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.sampling import SamplingParams
from tests.engine.scheduler_driver import EOS, Driver, assert_all_free, make_request

WINDOW = 8
BLOCK_SIZE = 4


def make_two_pool_scheduler(num_blocks: int, num_window_blocks: int, max_batch_tokens: int = 64,
                            max_running: int = 8) -> Scheduler:
    config = SchedulerConfig(max_batch_tokens=max_batch_tokens, max_running=max_running, max_waiting=16)
    return Scheduler(config, num_blocks, BLOCK_SIZE, 4096, eos_token_ids=frozenset({EOS}),
                     sliding_window_tokens=WINDOW, num_window_blocks=num_window_blocks)


def check_window_tables(driver: Driver) -> None:
    """Every step: the sliding tables cover each chunk, hold every block the chunk's window reaches,
    and no two sequences share a held block."""
    plan = driver.plans[-1]
    held: set[int] = set()
    for seq in plan.sequences:
        table = seq.window_block_ids
        end = seq.start_pos + len(seq.token_ids)
        assert table is not None and len(table) * BLOCK_SIZE >= end
        first_needed = max(0, seq.start_pos - WINDOW + 1) // BLOCK_SIZE
        needed = table[first_needed:-(-end // BLOCK_SIZE)]
        assert FREED_BLOCK_ID not in needed, f"{seq.request_id}: a block its window reaches was released"
        mine = {b for b in table if b != FREED_BLOCK_ID}
        assert not held & mine
        held |= mine


def run_checked(driver: Driver) -> None:
    while driver.s.has_work:
        assert len(driver.plans) < 1000
        driver.step()
        check_window_tables(driver)


def test_the_sliding_pool_releases_and_the_global_pool_keeps_every_block():
    d = Driver(make_two_pool_scheduler(num_blocks=32, num_window_blocks=32, max_batch_tokens=8))
    d.add(make_request("a", prompt_len=30, max_tokens=10))
    most_sliding = 0
    while d.s.has_work:
        d.step()
        check_window_tables(d)
        if d.s.has_work:
            assert FREED_BLOCK_ID not in d.s.blocks.block_ids("a")
            assert d.s.blocks.num_tokens("a") >= 30  # the whole prompt reserved on admission
        most_sliding = max(most_sliding, d.s.window_blocks.num_used_blocks)
    # computed at the end: 39 tokens; the next query at 39 sees 32..39, so blocks 0..7 went back
    assert d.s.num_window_released_blocks == (39 - WINDOW + 1) // BLOCK_SIZE == 8
    assert most_sliding <= -(-(WINDOW - 1 + 8) // BLOCK_SIZE) + 1
    assert d.s.window_blocks.num_used_blocks == 0
    assert_all_free(d.s)


def test_a_request_longer_than_the_sliding_pool_runs_and_either_pool_preempts():
    """The sliding pool (5 blocks) holds a window and a chunk of one request, not the 40 tokens of one,
    nor two requests' windows at once: the second is preempted by the sliding pool and recomputed."""
    d = Driver(make_two_pool_scheduler(num_blocks=32, num_window_blocks=5, max_batch_tokens=8))
    d.add(make_request("a", prompt_len=30, max_tokens=10))
    d.add(make_request("b", prompt_len=12, max_tokens=10))
    run_checked(d)
    assert set(d.finished) == {"a", "b"} and len(d.outputs["a"]) == len(d.outputs["b"]) == 10
    assert d.s.num_preemptions >= 1
    assert d.s.window_blocks.num_used_blocks == 0
    assert_all_free(d.s)


def test_a_request_must_fit_each_pool():
    s = make_two_pool_scheduler(num_blocks=8, num_window_blocks=5, max_batch_tokens=8)
    s.add(make_request("fits", prompt_len=20, max_tokens=12))  # 31 tokens: 8 global blocks, a window here
    with pytest.raises(InvalidArgument, match="needs 9 KV blocks; this engine has 8"):
        s.add(make_request("too-long", prompt_len=20, max_tokens=14))
    with pytest.raises(InvalidArgument, match="needs 5 KV blocks; this engine has 4"):
        Scheduler(SchedulerConfig(max_batch_tokens=8), 32, BLOCK_SIZE, 4096, sliding_window_tokens=WINDOW,
                  num_window_blocks=4).add(make_request("x", prompt_len=20, max_tokens=4))


def test_an_import_reserves_in_both_pools_and_a_cancel_frees_both():
    s = make_two_pool_scheduler(num_blocks=16, num_window_blocks=16)
    s.reserve_import("m", 20)
    assert s.blocks.num_used_blocks == s.window_blocks.num_used_blocks == 5
    s.cancel_import("m")
    assert s.blocks.num_used_blocks == s.window_blocks.num_used_blocks == 0


def run_alone(s: Scheduler, request: EngineRequest) -> list:
    """Run `request` to its end (the fake model samples token 5); the plans."""
    s.add(request)
    plans = []
    while s.has_work:
        plans.append(s.schedule())
        s.apply(plans[-1], StepResult({seq.request_id: 5 for seq in plans[-1].sequences if seq.sample}))
    return plans


@pytest.mark.parametrize("num_evicted, num_hit_blocks", [(5, 7), (6, 0)])
def test_a_cached_prefix_serves_when_both_pools_supply_it(num_evicted, num_hit_blocks):
    """A first request of 30 tokens leaves 7 full blocks cached in both pools, the sliding pool's first
    5 released on the way (so evicted first). A second request of the same 30 tokens and 2 more: the
    window of its next query (at 28) reaches blocks 5 and 6 only, so evicting the 5 released ones
    from the sliding pool still serves all 7; evicting one more serves none, in either pool."""
    s = Scheduler(SchedulerConfig(max_batch_tokens=64, max_running=8), 32, BLOCK_SIZE, 4096,
                  block_hasher=BlockHasher(BLOCK_SIZE, "salt"), sliding_window_tokens=WINDOW, num_window_blocks=32)
    prompt = list(range(10, 40))
    run_alone(s, EngineRequest("a", prompt, SamplingParams(max_tokens=1), seed=7))
    assert s.blocks.num_cached_blocks == s.window_blocks.num_cached_blocks == 7
    s.window_blocks.allocate("squeeze", (s.window_blocks.num_free_blocks + num_evicted) * BLOCK_SIZE)
    s.window_blocks.free("squeeze")
    plans = run_alone(s, EngineRequest("b", prompt + [50, 51], SamplingParams(max_tokens=2), seed=7))
    first = plans[0].sequences[0]
    assert first.start_pos == num_hit_blocks * BLOCK_SIZE == s.num_prefix_hit_tokens
    if num_hit_blocks:
        assert first.window_block_ids[:5] == (FREED_BLOCK_ID,) * 5 and FREED_BLOCK_ID not in first.block_ids
    assert s.blocks.num_used_blocks == s.window_blocks.num_used_blocks == 0


def test_the_budget_splits_by_bytes():
    # 3 of 4 layers slide over 1024 tokens, 16-token blocks, 4 running, 512 tokens a step:
    # the sliding pool needs 4 * (64 + 1) + 32 = 292 blocks; 3 * (1000 - 292) more go to the global layer
    assert split_kv_blocks(1000, 4, 3, 1024, 16, 4, 512) == (1000 + 3 * 708, 292)
    assert split_kv_blocks(100, 4, 3, 1024, 16, 4, 512) == (100, 100)  # never more than the global pool
    with pytest.raises(ValueError):
        split_kv_blocks(100, 4, 4, 1024, 16, 4, 512)
