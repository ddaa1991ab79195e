"""The pure scheduler driven by a fake model: no torch, no weights.

The fake model keeps its own copy of every sequence's "KV" (the tokens it was
fed, position by position) and checks each plan against it: chunks continue
where the cache ends, every token fed is the request's prompt + output token at
that position, block tables cover the tokens, and no two sequences share a
block. A sampled token is a hash of (request id, position, the cached tokens),
so a recompute that fed wrong tokens or sampled at a wrong position would change
the outputs.
"""

from __future__ import annotations

import zlib

import pytest

from dualpace.engine.request import EngineRequest, RequestEvent, RequestState
from dualpace.engine.scheduler import Scheduler, SchedulerConfig, StepPlan, StepResult
from dualpace.errors import InvalidArgument, Overloaded, RequestNotFound
from dualpace.sampling import FinishReason, SamplingParams

EOS = 2


def fake_token(request_id: str, position: int, context: list[int]) -> int:
    """The fake model's next token: >= 100, so never EOS or a small stop id unless forced."""
    key = f"{request_id}|{position}|{','.join(map(str, context))}".encode()
    return 100 + zlib.crc32(key) % 900


def make_request(request_id: str, prompt_len: int = 4, max_tokens: int = 4, **params) -> EngineRequest:
    base = zlib.crc32(request_id.encode()) % 50
    prompt = [10 + (base + i) % 80 for i in range(prompt_len)]
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), seed=7)


class Driver:
    """A scheduler plus a checking fake model; records outputs and finish reasons per request."""

    def __init__(self, scheduler: Scheduler, forced: dict[tuple[str, int], int | None] | None = None):
        self.s = scheduler
        self.forced = dict(forced or {})  # (request_id, sample position) -> token (None: non-finite logits)
        self.kv: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # prompt + outputs, as the client sees them
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.migrated: dict[str, str] = {}
        self.plans: list[StepPlan] = []

    # commands, mirrored into the fake model's state
    def add(self, request: EngineRequest) -> None:
        self.s.add(request)
        self.tokens[request.request_id] = list(request.prompt_token_ids)
        self.outputs[request.request_id] = []

    def abort(self, request_id: str) -> RequestEvent:
        event = self.s.abort(request_id)
        self._event(event)
        return event

    def release(self, request_id: str, migrated_to: str) -> RequestEvent:
        event = self.s.release(request_id, migrated_to)
        self._event(event)
        return event

    def commit_import(self, request: EngineRequest) -> None:
        self.s.commit_import(request)
        rid = request.request_id
        self.tokens[rid] = list(request.prompt_token_ids) + list(request.output_token_ids)
        self.outputs[rid] = list(request.output_token_ids)
        self.kv[rid] = self.tokens[rid][:-1]  # the imported KV

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.preempted_ids:
            self.kv.pop(rid, None)
        bs = self.s.blocks.block_size
        seen_blocks: set[int] = set()
        sampled: dict[str, int | None] = {}
        assert len(plan.sequences) <= self.s.config.max_running
        assert plan.num_tokens <= self.s.config.max_batch_tokens
        assert len({seq.request_id for seq in plan.sequences}) == len(plan.sequences)
        for seq in plan.sequences:
            rid = seq.request_id
            assert rid not in plan.preempted_ids
            assert seq.token_ids, "a scheduled sequence computes at least one token"
            cache = self.kv.setdefault(rid, [])
            assert seq.start_pos == len(cache), f"{rid}: chunk starts at {seq.start_pos}, cache holds {len(cache)}"
            cache.extend(seq.token_ids)
            assert cache == self.tokens[rid][: len(cache)], f"{rid}: fed tokens differ from prompt + outputs"
            assert len(seq.block_ids) * bs >= len(cache), f"{rid}: block table too short"
            assert not seen_blocks & set(seq.block_ids), "two sequences share a block"
            seen_blocks |= set(seq.block_ids)
            assert seq.sample == (len(cache) == len(self.tokens[rid]))
            if seq.sample:
                position = seq.sample_position
                assert position == len(self.tokens[rid])
                if (rid, position) in self.forced:
                    sampled[rid] = self.forced[(rid, position)]
                else:
                    sampled[rid] = fake_token(rid, position, cache)
        return StepResult(sampled)

    def step(self) -> tuple[StepPlan, list[RequestEvent]]:
        plan = self.s.schedule()
        self.plans.append(plan)
        events = self.s.apply(plan, self.execute(plan))
        for event in events:
            self._event(event)
        return plan, events

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.s.has_work:
            assert steps < max_steps, "the scheduler did not drain"
            self.step()
            steps += 1
        return steps

    def _event(self, event: RequestEvent) -> None:
        rid = event.request_id
        self.tokens.setdefault(rid, []).extend(event.new_token_ids)
        self.outputs.setdefault(rid, []).extend(event.new_token_ids)
        if event.finish_reason is not None:
            assert rid not in self.finished
            self.finished[rid] = event.finish_reason
        if event.migrated_to is not None:
            self.migrated[rid] = event.migrated_to
        if event.finish_reason is not None or event.migrated_to is not None:
            self.kv.pop(rid, None)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_batch_tokens: int = 64,
    max_running: int = 8,
    max_waiting: int = 16,
    max_context_tokens: int = 4096,
) -> Scheduler:
    config = SchedulerConfig(max_batch_tokens=max_batch_tokens, max_running=max_running, max_waiting=max_waiting)
    return Scheduler(config, num_blocks, block_size, max_context_tokens, eos_token_ids=frozenset({EOS}))


def assert_all_free(s: Scheduler) -> None:
    assert s.blocks.num_used_blocks == 0
    assert s.blocks.num_free_blocks == s.blocks.num_total_blocks
    assert s.blocks.seq_ids() == []
    assert not s.requests and not s.running and not s.waiting
    assert not s.has_work


# ----------------------------------------------------------------- admission and batching


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
