"""The pure scheduler driven by a fake model (tests/engine/scheduler_driver.py, which checks
every plan against the tokens it was fed): admission, chunked prefill, preemption, aborts,
stop conditions. No torch, no weights."""

from __future__ import annotations

import pytest

from dualpace.engine.request import RequestEvent, RequestState
from dualpace.engine.scheduler import Scheduler
from dualpace.errors import InvalidArgument, Overloaded, RequestNotFound
from dualpace.sampling import FinishReason
from tests.engine.scheduler_driver import EOS, Driver, assert_all_free, make_request, make_scheduler


def test_fcfs_admission_and_running_order():
    d = Driver(make_scheduler(max_running=2))
    for rid in ("a", "b", "c"):
        d.add(make_request(rid, prompt_len=3, max_tokens=2))
    plan, _ = d.step()
    assert [seq.request_id for seq in plan.sequences] == ["a", "b"]
    assert [r.request_id for r in d.s.running] == ["a", "b"]
    assert [r.request_id for r in d.s.waiting] == ["c"]
    assert d.s.get("c").state == RequestState.WAITING
    plan, _ = d.step()  # a and b sample their last token and finish
    assert d.finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    plan, _ = d.step()
    assert [seq.request_id for seq in plan.sequences] == ["c"]
    d.run()
    assert_all_free(d.s)


def test_head_of_line_request_is_not_overtaken():
    # 6 blocks of 4: "a" takes 3 blocks for its prompt; "b" needs 4 and must wait,
    # and the small "c" behind it is not admitted ahead of it.
    d = Driver(make_scheduler(num_blocks=6, block_size=4))
    d.add(make_request("a", prompt_len=12, max_tokens=4))
    d.add(make_request("b", prompt_len=14, max_tokens=4))
    d.add(make_request("c", prompt_len=2, max_tokens=2))
    plan, _ = d.step()
    assert [seq.request_id for seq in plan.sequences] == ["a"]
    assert [r.request_id for r in d.s.waiting] == ["b", "c"]
    order = []
    while d.s.has_work:
        plan, _ = d.step()
        for seq in plan.sequences:
            if seq.start_pos == 0 and seq.request_id not in order:
                order.append(seq.request_id)
    assert order == ["b", "c"]
    assert set(d.finished) == {"a", "b", "c"}
    assert_all_free(d.s)


def test_chunked_prefill_under_the_token_budget():
    d = Driver(make_scheduler(max_batch_tokens=8))
    request = make_request("long", prompt_len=20, max_tokens=3)
    d.add(request)
    chunks = []
    for _ in range(3):
        plan, events = d.step()
        (seq,) = plan.sequences
        chunks.append((seq.start_pos, len(seq.token_ids), seq.sample))
        assert seq.token_ids == tuple(request.prompt_token_ids[seq.start_pos : seq.start_pos + len(seq.token_ids)])
        assert request.num_computed_tokens == seq.start_pos + len(seq.token_ids)
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert len(d.outputs["long"]) == 1 and events[0].new_token_ids == tuple(d.outputs["long"])
    # decode steps: one token each, positions continue
    for expected_start in (20, 21):
        plan, _ = d.step()
        (seq,) = plan.sequences
        assert (seq.start_pos, len(seq.token_ids), seq.sample) == (expected_start, 1, True)
        assert seq.sample_position == expected_start + 1
        assert seq.token_ids == (request.output_token_ids[expected_start - 20],)
    assert d.finished == {"long": FinishReason.LENGTH}
    assert len(d.outputs["long"]) == 3
    assert_all_free(d.s)


def test_decodes_first_then_prefill_chunks_fill_the_budget():
    d = Driver(make_scheduler(max_batch_tokens=6))
    d.add(make_request("a", prompt_len=3, max_tokens=8))
    d.step()  # a's prompt; a now decodes
    d.add(make_request("b", prompt_len=12, max_tokens=2))
    plan, _ = d.step()
    assert [(s.request_id, len(s.token_ids), s.sample) for s in plan.sequences] == [("a", 1, True), ("b", 5, False)]
    plan, _ = d.step()
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.sequences] == [("a", 4, 1), ("b", 5, 5)]
    d.run()
    assert_all_free(d.s)


def test_max_running_bounds_every_step():
    d = Driver(make_scheduler(max_running=2, max_batch_tokens=64))
    for i in range(5):
        d.add(make_request(f"r{i}", prompt_len=3, max_tokens=3))
    while d.s.has_work:
        plan, _ = d.step()
        assert len(plan.sequences) <= 2
        assert d.s.num_running <= 2
    assert len(d.finished) == 5
    assert_all_free(d.s)


def test_queries():
    d = Driver(make_scheduler(max_running=1))
    assert not d.s.has_work and d.s.num_running == 0 and d.s.num_waiting == 0
    d.add(make_request("a"))
    d.add(make_request("b"))
    assert d.s.has_work and d.s.num_waiting == 2
    d.step()
    assert (d.s.num_running, d.s.num_waiting) == (1, 1)
    assert d.s.get("a").state == RequestState.RUNNING
    with pytest.raises(RequestNotFound):
        d.s.get("zzz")


# ----------------------------------------------------------------- KV exhaustion and preemption


def _preemption_setup() -> tuple[Driver, Scheduler]:
    # 6 blocks of 4 (24 slots). Each request alone fits (8 + 12 - 1 = 19 slots), both together do not.
    s = make_scheduler(num_blocks=6, block_size=4, max_batch_tokens=32)
    d = Driver(s)
    d.add(make_request("old", prompt_len=8, max_tokens=12))
    d.add(make_request("new", prompt_len=8, max_tokens=12))
    return d, s


def test_kv_exhaustion_preempts_the_newest_and_recomputes():
    d, s = _preemption_setup()
    plan, _ = d.step()
    assert [seq.request_id for seq in plan.sequences] == ["old", "new"]
    while True:
        plan, _ = d.step()
        if plan.preempted_ids:
            break
    assert plan.preempted_ids == ("new",)
    assert [seq.request_id for seq in plan.sequences] == ["old"]
    new = s.get("new")
    assert new.state == RequestState.WAITING
    assert new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and s.num_preemptions == 1
    assert not s.blocks.has("new")
    assert [r.request_id for r in s.waiting] == ["new"] and [r.request_id for r in s.running] == ["old"]
    kept = list(new.output_token_ids)
    assert kept and kept == d.outputs["new"]  # outputs survive preemption
    assert s.blocks.num_used_blocks == len(s.blocks.block_ids("old"))

    # "new" comes back once "old" finishes and recomputes prompt + outputs in one chunk
    while True:
        plan, _ = d.step()
        seqs = [seq for seq in plan.sequences if seq.request_id == "new"]
        if seqs:
            break
    (seq,) = seqs
    assert "old" in d.finished
    assert seq.start_pos == 0
    assert seq.token_ids == tuple(new.prompt_token_ids + kept)
    assert seq.sample and seq.sample_position == 8 + len(kept)
    assert new.output_token_ids[: len(kept)] == kept
    d.run()
    assert d.finished == {"old": FinishReason.LENGTH, "new": FinishReason.LENGTH}
    assert_all_free(s)

    # the outputs equal those of a run with ample KV
    ample = Driver(make_scheduler(num_blocks=64, block_size=4, max_batch_tokens=32))
    ample.add(make_request("old", prompt_len=8, max_tokens=12))
    ample.add(make_request("new", prompt_len=8, max_tokens=12))
    ample.run()
    assert ample.s.num_preemptions == 0
    assert d.outputs == ample.outputs
    assert all(len(out) == 12 for out in d.outputs.values())


def test_recompute_is_chunked_and_samples_only_at_the_end():
    s = make_scheduler(num_blocks=6, block_size=4, max_batch_tokens=8)
    d = Driver(s)
    d.add(make_request("old", prompt_len=8, max_tokens=12))
    d.add(make_request("new", prompt_len=8, max_tokens=12))
    while not any(plan.preempted_ids for plan in d.plans):
        d.step()
    kept = len(s.get("new").output_token_ids)
    total = 8 + kept
    recompute = []
    while s.has_work:
        plan, _ = d.step()
        recompute += [
            (seq.start_pos, len(seq.token_ids), seq.sample) for seq in plan.sequences if seq.request_id == "new"
        ]
        if recompute and recompute[-1][2]:
            break
    starts = [start for start, _, _ in recompute]
    assert starts[0] == 0 and sum(n for _, n, _ in recompute) == total
    assert [sample for _, _, sample in recompute] == [False] * (len(recompute) - 1) + [True]
    assert all(n <= 8 for _, n, _ in recompute) and len(recompute) > 1
    d.run()
    assert_all_free(s)


def test_a_request_that_preempts_itself_does_not_admit_others_that_step():
    d, s = _preemption_setup()
    d.add(make_request("later", prompt_len=1, max_tokens=1))
    while True:
        plan, _ = d.step()
        if plan.preempted_ids:
            break
    assert "later" not in {seq.request_id for seq in plan.sequences}
    d.run()
    assert set(d.finished) == {"old", "new", "later"}
    assert_all_free(s)


# ----------------------------------------------------------------- add errors


def test_request_that_can_never_fit_names_max_tokens():
    s = make_scheduler(num_blocks=4, block_size=4)  # 16 slots
    s.add(make_request("fits", prompt_len=8, max_tokens=9))  # 8 + 9 - 1 = 16 slots: exactly fits
    with pytest.raises(InvalidArgument) as info:
        s.add(make_request("big", prompt_len=8, max_tokens=10))
    assert info.value.field == "max_tokens"
    assert "big" not in s.requests and s.num_waiting == 1


def test_full_queue_is_overloaded():
    s = make_scheduler(max_waiting=2)
    s.add(make_request("a"))
    s.add(make_request("b"))
    with pytest.raises(Overloaded):
        s.add(make_request("c"))
    assert "c" not in s.requests and s.num_waiting == 2


def test_duplicate_and_empty_ids_are_invalid():
    d = Driver(make_scheduler())
    d.add(make_request("a"))
    with pytest.raises(InvalidArgument) as info:
        d.s.add(make_request("a"))
    assert info.value.field == "request_id"
    d.step()  # now running
    with pytest.raises(InvalidArgument):
        d.s.add(make_request("a"))
    d.s.reserve_import("imp", 5)
    with pytest.raises(InvalidArgument):
        d.s.add(make_request("imp"))
    with pytest.raises(InvalidArgument):
        d.s.reserve_import("a", 5)
    with pytest.raises(InvalidArgument):
        d.s.add(make_request(""))


# ----------------------------------------------------------------- abort


def _abort_and_check(d: Driver, rid: str) -> None:
    event = d.abort(rid)
    assert event == RequestEvent(rid, finish_reason=FinishReason.ABORT)
    assert rid not in d.s.requests
    assert not d.s.blocks.has(rid)
    assert rid not in {r.request_id for r in d.s.running + d.s.waiting}
    with pytest.raises(RequestNotFound):
        d.s.abort(rid)


def test_abort_in_every_state_frees_everything():
    d = Driver(make_scheduler(max_running=2))
    d.add(make_request("running", prompt_len=5, max_tokens=8))
    d.add(make_request("paused", prompt_len=5, max_tokens=8))
    d.add(make_request("waiting", prompt_len=5, max_tokens=8))
    d.step()
    d.s.pause("paused")
    blocks = d.s.reserve_import("importing", 6)
    assert blocks and d.s.blocks.has("importing")
    for rid in ("waiting", "paused", "running"):
        _abort_and_check(d, rid)
    assert d.abort("importing") == RequestEvent("importing", finish_reason=FinishReason.ABORT)
    with pytest.raises(RequestNotFound):
        d.s.abort("importing")
    assert_all_free(d.s)


def test_abort_of_a_preempted_request():
    d, s = _preemption_setup()
    while not any(plan.preempted_ids for plan in d.plans):
        d.step()
    assert s.get("new").output_token_ids
    _abort_and_check(d, "new")
    d.run()
    assert d.finished == {"old": FinishReason.LENGTH, "new": FinishReason.ABORT}
    assert_all_free(s)


def test_abort_mid_prefill_and_unknown():
    d = Driver(make_scheduler(max_batch_tokens=4))
    d.add(make_request("a", prompt_len=10))
    d.step()
    assert d.s.get("a").num_computed_tokens == 4
    _abort_and_check(d, "a")
    assert_all_free(d.s)
    with pytest.raises(RequestNotFound):
        d.s.abort("nobody")


# ----------------------------------------------------------------- stop conditions


def test_eos_stops_unless_ignore_eos():
    d = Driver(make_scheduler(), forced={("eos", 6): EOS, ("ign", 6): EOS})
    d.add(make_request("eos", prompt_len=4, max_tokens=10))
    d.add(make_request("ign", prompt_len=4, max_tokens=5, ignore_eos=True))
    d.run()
    assert d.finished == {"eos": FinishReason.STOP, "ign": FinishReason.LENGTH}
    assert len(d.outputs["eos"]) == 3 and d.outputs["eos"][-1] == EOS
    assert len(d.outputs["ign"]) == 5 and d.outputs["ign"][2] == EOS
    assert_all_free(d.s)


def test_stop_token_ids_stop():
    d = Driver(make_scheduler(), forced={("a", 5): 7})
    d.add(make_request("a", prompt_len=4, max_tokens=10, stop_token_ids=(7,)))
    d.add(make_request("b", prompt_len=4, max_tokens=4, stop_token_ids=(8,)))  # never sampled
    d.run()
    assert d.finished == {"a": FinishReason.STOP, "b": FinishReason.LENGTH}
    assert d.outputs["a"][-1] == 7 and len(d.outputs["a"]) == 2


def test_max_tokens_stops_with_the_event_carrying_the_last_token():
    d = Driver(make_scheduler())
    d.add(make_request("a", prompt_len=3, max_tokens=1))
    plan, events = d.step()
    assert len(events) == 1
    (event,) = events
    assert event.finish_reason == FinishReason.LENGTH and len(event.new_token_ids) == 1
    assert_all_free(d.s)


def test_context_limit_stops_with_length():
    d = Driver(make_scheduler(max_context_tokens=7))
    d.add(make_request("a", prompt_len=4, max_tokens=20))
    d.run()
    assert d.finished == {"a": FinishReason.LENGTH}
    assert len(d.tokens["a"]) == 7 and len(d.outputs["a"]) == 3
    assert max(seq.sample_position for plan in d.plans for seq in plan.sequences) == 6
    assert_all_free(d.s)


def test_none_sample_errors_only_that_request():
    d = Driver(make_scheduler(), forced={("bad", 5): None})
    d.add(make_request("good", prompt_len=4, max_tokens=4))
    d.add(make_request("bad", prompt_len=4, max_tokens=4))
    plan, events = d.step()
    assert len(events) == 2
    plan, events = d.step()
    by_id = {e.request_id: e for e in events}
    assert by_id["bad"] == RequestEvent("bad", finish_reason=FinishReason.ERROR)
    assert by_id["good"].finish_reason is None and len(by_id["good"].new_token_ids) == 1
    assert "bad" not in d.s.requests and not d.s.blocks.has("bad")
    d.run()
    assert d.finished == {"bad": FinishReason.ERROR, "good": FinishReason.LENGTH}
    assert len(d.outputs["good"]) == 4 and len(d.outputs["bad"]) == 1
    assert_all_free(d.s)


# ----------------------------------------------------------------- pause, resume, release
