"""The pure scheduler's side of migration: pause, release, import (reserve, commit, cancel),
driven by the fake model of scheduler_driver.py."""

from __future__ import annotations

import pytest

from dualpace.engine.request import RequestEvent, RequestState
from dualpace.errors import InvalidArgument, Overloaded, RequestNotFound
from dualpace.sampling import FinishReason
from tests.engine.scheduler_driver import Driver, assert_all_free, make_request, make_scheduler


def test_pause_decoding_or_waiting_requests_not_prefilling_ones():
    d = Driver(make_scheduler(max_batch_tokens=4, max_running=1))
    d.add(make_request("a", prompt_len=6, max_tokens=8))
    d.add(make_request("w", prompt_len=2, max_tokens=2))
    waiting = d.s.pause("w")  # a queued request moves without KV
    assert waiting.state == RequestState.PAUSED and waiting.num_computed_tokens == 0 and not d.s.blocks.has("w")
    d.s.resume("w")
    assert d.s.get("w").state == RequestState.WAITING and d.s.waiting[-1].request_id == "w"
    d.step()  # a: 4 of 6 prompt tokens
    with pytest.raises(InvalidArgument):
        d.s.pause("a")  # prefilling
    with pytest.raises(RequestNotFound):
        d.s.pause("nobody")
    d.step()  # a: last 2 prompt tokens and its first sample
    paused = d.s.pause("a")
    assert paused.state == RequestState.PAUSED
    with pytest.raises(InvalidArgument):
        d.s.pause("a")


def test_pause_refuses_a_prompt_with_one_token_left():
    # 5-token prompt in chunks of 4: after one step one prompt token is pending but
    # nothing was sampled yet, so the cache does not hold "every token but the last sampled one".
    d = Driver(make_scheduler(max_batch_tokens=4))
    d.add(make_request("a", prompt_len=5, max_tokens=4))
    d.step()
    assert d.s.get("a").num_pending_tokens == 1
    with pytest.raises(InvalidArgument):
        d.s.pause("a")


def test_paused_request_keeps_blocks_and_resumes_where_it_stopped():
    d = Driver(make_scheduler())
    d.add(make_request("a", prompt_len=4, max_tokens=6))
    d.add(make_request("b", prompt_len=4, max_tokens=6))
    d.step()
    d.step()
    a = d.s.pause("a")
    assert a.num_computed_tokens == a.num_tokens - 1  # every token but the last sampled one
    blocks = d.s.blocks.block_ids("a")
    assert d.s.blocks.num_tokens("a") == a.num_computed_tokens
    plan, _ = d.step()
    assert [seq.request_id for seq in plan.sequences] == ["b"]
    assert d.s.blocks.block_ids("a") == blocks and a.state == RequestState.PAUSED
    assert d.s.has_work
    d.s.resume("a")
    assert a.state == RequestState.RUNNING
    assert [r.request_id for r in d.s.running] == ["a", "b"]  # arrival order kept
    plan, _ = d.step()
    assert [(seq.request_id, seq.start_pos) for seq in plan.sequences] == [("a", 5), ("b", 6)]
    with pytest.raises(InvalidArgument):
        d.s.resume("a")
    d.run()
    assert len(d.outputs["a"]) == 6 and len(d.outputs["b"]) == 6
    assert_all_free(d.s)


def test_paused_only_work_is_not_has_work():
    d = Driver(make_scheduler())
    d.add(make_request("a", prompt_len=4, max_tokens=6))
    d.step()
    d.s.pause("a")
    assert not d.s.has_work
    assert d.s.schedule().is_empty


def test_release_frees_and_reports_migration():
    d = Driver(make_scheduler())
    d.add(make_request("a", prompt_len=4, max_tokens=6))
    d.step()
    with pytest.raises(InvalidArgument):
        d.s.release("a", "elsewhere")  # not paused
    d.s.pause("a")
    event = d.release("a", "gpu-0")
    assert event == RequestEvent("a", migrated_to="gpu-0")
    assert d.s.blocks.num_used_blocks == 0 and "a" not in d.s.requests
    with pytest.raises(RequestNotFound):
        d.s.release("a", "gpu-0")
    assert_all_free(d.s)


# ----------------------------------------------------------------- import


def _imported_request(rid: str = "imp", prompt_len: int = 5, num_outputs: int = 3, max_tokens: int = 6):
    request = make_request(rid, prompt_len=prompt_len, max_tokens=max_tokens)
    request.output_token_ids = [200 + i for i in range(num_outputs)]
    request.state = RequestState.PAUSED  # as it arrives from elsewhere
    return request


def test_import_reserve_commit_then_continue():
    d = Driver(make_scheduler(num_blocks=16, block_size=4))
    request = _imported_request()
    block_ids = d.s.reserve_import("imp", request.num_tokens - 1)
    assert len(block_ids) == 2 == d.s.blocks.num_used_blocks  # 7 tokens in blocks of 4
    assert not d.s.has_work and "imp" not in d.s.requests
    d.commit_import(request)
    assert request.state == RequestState.RUNNING
    assert request.num_computed_tokens == request.num_tokens - 1 == 7
    assert d.s.get("imp") is request and d.s.num_running == 1
    plan, events = d.step()
    (seq,) = plan.sequences
    assert (seq.start_pos, seq.token_ids, seq.sample, seq.sample_position) == (7, (202,), True, 8)
    assert list(seq.block_ids[:2]) == block_ids
    d.run()
    assert d.finished == {"imp": FinishReason.LENGTH}
    assert len(d.outputs["imp"]) == 6  # max_tokens counts the outputs made elsewhere
    assert_all_free(d.s)


def test_imported_request_joins_in_arrival_order_after_running_ones():
    d = Driver(make_scheduler())
    d.add(make_request("a", prompt_len=4, max_tokens=8))
    d.step()
    request = _imported_request()
    d.s.reserve_import("imp", request.num_tokens - 1)
    d.commit_import(request)
    assert [r.request_id for r in d.s.running] == ["a", "imp"]
    d.run()
    assert_all_free(d.s)


def test_commit_import_refuses_a_request_that_could_never_be_readmitted():
    # 3 blocks of 4: the 9 tokens held fit, but prompt + max_tokens - 1 = 15 tokens never would,
    # so after a preemption it would wait forever at the head of the queue.
    d = Driver(make_scheduler(num_blocks=3, block_size=4))
    request = _imported_request(prompt_len=6, num_outputs=3, max_tokens=10)
    d.s.reserve_import("imp", request.num_tokens - 1)
    with pytest.raises(InvalidArgument) as info:
        d.s.commit_import(request)
    assert info.value.field == "max_tokens"
    assert "imp" not in d.s.requests and d.s.blocks.has("imp")  # still reserved, for the caller to cancel
    d.s.cancel_import("imp")
    assert_all_free(d.s)
    # at exactly the pool's size it is accepted and finishes, preempting nothing
    request = _imported_request(prompt_len=6, num_outputs=3, max_tokens=7)
    d.s.reserve_import("imp", request.num_tokens - 1)
    d.commit_import(request)
    d.run()
    assert d.finished == {"imp": FinishReason.LENGTH} and d.s.num_preemptions == 0
    assert_all_free(d.s)


def test_import_overloaded_when_blocks_are_short():
    s = make_scheduler(num_blocks=4, block_size=4)
    s.reserve_import("one", 8)  # 2 blocks
    with pytest.raises(Overloaded):
        s.reserve_import("two", 8)  # 8 + 1 slots need 3 blocks, 2 are free
    assert s.blocks.num_used_blocks == 2 and not s.blocks.has("two")
    s.reserve_import("two", 7)  # 7 + 1 slots fit in 2 blocks
    assert s.blocks.num_free_blocks == 0


def test_commit_import_errors_and_cancel():
    d = Driver(make_scheduler())
    request = _imported_request()
    with pytest.raises(RequestNotFound):
        d.s.commit_import(request)
    d.s.reserve_import("imp", 5)  # does not cover 7 tokens
    with pytest.raises(InvalidArgument):
        d.s.commit_import(request)
    assert d.s.blocks.has("imp") and "imp" not in d.s.requests
    d.s.cancel_import("imp")
    assert_all_free(d.s)
    d.s.cancel_import("imp")  # idempotent
    d.s.cancel_import("nobody")
    d.s.reserve_import("imp", 7)  # the id is free again
    d.s.cancel_import("imp")
    assert_all_free(d.s)


def test_an_import_reserved_ahead_is_adopted_by_its_request_and_cut_to_its_tokens():
    d = Driver(make_scheduler(num_blocks=16, block_size=4))
    reserved = d.s.reserve_import("ahead", 16, ahead=True)  # 4 blocks, before the request is known
    assert (d.s.blocks.num_used_blocks, d.s.num_used_blocks) == (4, 0)  # they stand for the next import
    request = _imported_request()  # 7 tokens of KV: 2 blocks
    with pytest.raises(RequestNotFound):
        d.s.adopt_import("nobody", "imp", 7)
    with pytest.raises(InvalidArgument):
        d.s.adopt_import("ahead", "imp", 17)  # more than was reserved
    d.add(make_request("busy", prompt_len=4, max_tokens=2))
    with pytest.raises(InvalidArgument):
        d.s.adopt_import("ahead", "busy", 7)  # that id is taken
    assert d.s.blocks.block_ids("ahead") == reserved  # a refused adoption changed nothing
    d.s.adopt_import("ahead", "imp", request.num_tokens - 1)
    assert not d.s.blocks.has("ahead") and d.s.blocks.block_ids("imp") == reserved[:2]
    assert d.s.blocks.num_used_blocks == d.s.num_used_blocks == 2  # the two past its tokens are free again
    with pytest.raises(RequestNotFound):
        d.s.adopt_import("ahead", "other", 4)  # once
    d.commit_import(request)
    d.run()
    assert d.finished["imp"] == FinishReason.LENGTH and len(d.outputs["imp"]) == 6
    assert_all_free(d.s)


def test_an_import_reserved_ahead_and_never_adopted_is_cancelled_like_any_import():
    d = Driver(make_scheduler(num_blocks=8, block_size=4))
    d.s.reserve_import("ahead", 12, ahead=True)
    d.s.cancel_import("ahead")
    assert_all_free(d.s)
    d.s.reserve_import("ahead", 12)  # the id is free again; a plain import's blocks count as used
    assert d.s.num_used_blocks == 3
