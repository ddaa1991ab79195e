"""Property tests of the pure scheduler: random command sequences over a small KV pool,
with the checking fake model of test_scheduler (it asserts every plan's positions,
tokens and block tables), and bookkeeping invariants after every command."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dualpace.engine.request import RequestState
from dualpace.errors import InvalidArgument, Overloaded
from dualpace.sampling import FinishReason
from tests.engine.scheduler_driver import EOS, Driver, assert_all_free, make_request, make_scheduler

DRAIN_STEPS = 2000


def check_invariants(d: Driver, importing: set[str] = frozenset()) -> None:
    s = d.s
    blocks = s.blocks
    running = [r.request_id for r in s.running]
    waiting = [r.request_id for r in s.waiting]
    paused = [rid for rid, r in s.requests.items() if r.state == RequestState.PAUSED]
    # no request twice, none both waiting and running; the dict holds exactly the live ones
    assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
    assert not set(running) & set(waiting)
    assert set(running) | set(waiting) | set(paused) == set(s.requests)
    assert len(running) + len(waiting) + len(paused) == len(s.requests)
    for rid, request in s.requests.items():
        assert request.request_id == rid and request.state != RequestState.FINISHED
        assert (rid in running) == (request.state == RequestState.RUNNING)
        assert (rid in waiting) == (request.state == RequestState.WAITING)
        assert rid not in d.finished
    # arrival order
    assert [r.arrival_index for r in s.running] == sorted(r.arrival_index for r in s.running)
    assert [r.arrival_index for r in s.waiting] == sorted(r.arrival_index for r in s.waiting)
    # blocks: waiting requests hold none, the others hold exactly the used ones
    assert not any(blocks.has(rid) for rid in waiting)
    holders = set(running) | set(paused) | set(importing)
    assert set(blocks.seq_ids()) == holders
    assert blocks.num_used_blocks == sum(len(blocks.block_ids(rid)) for rid in holders)
    assert blocks.num_free_blocks + blocks.num_used_blocks == blocks.num_total_blocks
    for rid in running + paused:
        request = s.requests[rid]
        assert blocks.num_tokens(rid) >= request.num_computed_tokens
        assert len(blocks.block_ids(rid)) * blocks.block_size >= request.num_computed_tokens
        assert 0 <= request.num_computed_tokens < request.num_tokens
    for rid in waiting:
        assert s.requests[rid].num_computed_tokens == 0
    # outputs: what the scheduler holds is what the client was sent
    for rid, request in s.requests.items():
        assert request.output_token_ids == d.outputs[rid]
        assert len(request.output_token_ids) < request.params.max_tokens


def drain(d: Driver, importing: set[str] = frozenset()) -> None:
    for rid in importing:
        d.s.cancel_import(rid)
    for rid in [rid for rid, r in d.s.requests.items() if r.state == RequestState.PAUSED]:
        d.s.resume(rid)
    d.run(max_steps=DRAIN_STEPS)
    assert set(d.finished) | set(d.migrated) == set(d.outputs)
    assert_all_free(d.s)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 10),
        block_size=st.sampled_from([1, 2, 3]),
        max_batch_tokens=st.integers(1, 12),
        max_running=st.integers(0, 3).map(lambda x: 4 - x),  # mostly several at once
        max_waiting=st.integers(0, 5).map(lambda x: 6 - x),
    )
    def setup(self, num_blocks, block_size, max_batch_tokens, max_running, max_waiting):
        scheduler = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            max_waiting=max_waiting,
            max_context_tokens=40,
        )
        self.d = Driver(scheduler)
        self.importing: set[str] = set()
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _sizes(self, data, min_extra: int = 0) -> tuple[int, int]:
        """(prompt_len, max_tokens) scaled to the pool; now and then one that can never fit."""
        capacity = self.d.s.blocks.num_total_blocks * self.d.s.blocks.block_size
        # prompt + max_tokens - 1; hypothesis favours small draws, so mostly long requests that compete for KV
        longest = capacity + min_extra - data.draw(st.integers(-1, capacity - 1))
        prompt_len = data.draw(st.integers(1 + min_extra, longest)) - min_extra
        return prompt_len, longest - prompt_len + 1

    @rule(data=st.data(), count=st.integers(1, 3))
    def add(self, data, count):
        for _ in range(count):
            self._add_one(data)

    def _add_one(self, data):
        rid = self._new_id()
        eos_at = data.draw(st.integers(0, 30))
        prompt_len, max_tokens = self._sizes(data)
        request = make_request(rid, prompt_len=prompt_len, max_tokens=max_tokens)
        if eos_at < 10:  # else it runs to max_tokens
            self.d.forced[(rid, prompt_len + eos_at)] = EOS
        s = self.d.s
        fits = s.blocks.num_blocks_for(prompt_len - 1 + max_tokens) <= s.blocks.num_total_blocks
        try:
            self.d.add(request)
        except InvalidArgument as exc:
            assert not fits and exc.field == "max_tokens"
            return
        except Overloaded:
            assert s.num_waiting >= s.config.max_waiting
            return
        assert fits

    @rule(steps=st.sampled_from([16, 1, 4, 2, 8, 32]))
    def step(self, steps):
        for _ in range(steps):
            _, events = self.d.step()
            for event in events:
                assert event.new_token_ids or event.finish_reason == FinishReason.ERROR
            check_invariants(self.d, self.importing)

    @precondition(lambda self: self.d.s.requests)
    @rule(data=st.data(), really=st.integers(0, 2))
    def abort(self, data, really):
        if really:  # abort a third of the time, so requests live long enough to be preempted
            return
        rid = data.draw(st.sampled_from(sorted(self.d.s.requests)))
        self.d.abort(rid)
        assert self.d.finished[rid] == FinishReason.ABORT

    @precondition(lambda self: any(r.output_token_ids and r.num_pending_tokens == 1 for r in self.d.s.running))
    @rule(data=st.data(), resume_now=st.booleans())
    def pause(self, data, resume_now):
        candidates = sorted(r.request_id for r in self.d.s.running if r.output_token_ids and r.num_pending_tokens == 1)
        rid = data.draw(st.sampled_from(candidates))
        request = self.d.s.pause(rid)
        assert request.state == RequestState.PAUSED
        assert request.num_computed_tokens == request.num_tokens - 1
        if resume_now:
            self.d.s.resume(rid)

    @precondition(lambda self: any(r.state == RequestState.PAUSED for r in self.d.s.requests.values()))
    @rule(data=st.data(), release=st.booleans())
    def resume_or_release(self, data, release):
        paused = sorted(rid for rid, r in self.d.s.requests.items() if r.state == RequestState.PAUSED)
        rid = data.draw(st.sampled_from(paused))
        if release:
            self.d.release(rid, "elsewhere")
        else:
            self.d.s.resume(rid)

    @rule(data=st.data(), commit=st.booleans())
    def import_request(self, data, commit):
        rid = self._new_id()
        prompt_len, max_tokens = self._sizes(data, min_extra=1)
        num_outputs = data.draw(st.integers(1, max_tokens - 1))
        request = make_request(rid, prompt_len=prompt_len, max_tokens=max_tokens)
        request.output_token_ids = [300 + i for i in range(num_outputs)]
        try:
            self.d.s.reserve_import(rid, request.num_tokens - 1)
        except Overloaded:
            assert not self.d.s.blocks.can_allocate(request.num_tokens)
            return
        if not commit:
            self.importing.add(rid)
            return
        blocks = self.d.s.blocks
        fits = blocks.num_blocks_for(prompt_len - 1 + request.params.max_tokens) <= blocks.num_total_blocks
        try:
            self.d.commit_import(request)
        except InvalidArgument as exc:
            assert not fits and exc.field == "max_tokens"
            self.d.s.cancel_import(rid)
            return
        assert fits

    @precondition(lambda self: self.importing)
    @rule(data=st.data())
    def cancel_import(self, data):
        rid = data.draw(st.sampled_from(sorted(self.importing)))
        self.importing.discard(rid)
        self.d.s.cancel_import(rid)

    @invariant()
    def consistent(self):
        if hasattr(self, "d"):
            check_invariants(self.d, self.importing)

    def teardown(self):
        if hasattr(self, "d"):
            drain(self.d, self.importing)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


requests_strategy = st.lists(
    # prompt_len, max_tokens (hypothesis favours small draws: mostly long generations), arrival step
    st.tuples(st.integers(1, 12), st.integers(0, 11).map(lambda x: 12 - x), st.integers(0, 3)),
    min_size=1,
    max_size=6,
)


def _run(num_blocks: int, block_size: int, max_batch_tokens: int, requests) -> Driver:
    d = Driver(make_scheduler(num_blocks=num_blocks, block_size=block_size, max_batch_tokens=max_batch_tokens))
    step = 0
    pending = sorted(enumerate(requests), key=lambda item: item[1][2])
    while pending or d.s.has_work:
        while pending and pending[0][1][2] <= step:
            i, (prompt_len, max_tokens, _) = pending.pop(0)
            d.add(make_request(f"q{i}", prompt_len=prompt_len, max_tokens=max_tokens))
        d.step()
        step += 1
        assert step < DRAIN_STEPS
        check_invariants(d)
    assert_all_free(d.s)
    return d


@settings(max_examples=60, deadline=None)
@given(requests=requests_strategy, block_size=st.sampled_from([1, 2, 4]), max_batch_tokens=st.integers(1, 16))
def test_outputs_do_not_depend_on_kv_pressure(requests, block_size, max_batch_tokens):
    """Preemption and recompute change when tokens are made, never which tokens."""
    largest = max(prompt_len - 1 + max_tokens for prompt_len, max_tokens, _ in requests)
    small = -(-largest // block_size)  # just enough for the largest request alone
    tight = _run(small, block_size, max_batch_tokens, requests)
    ample = _run(64 * 8 // block_size, block_size, max_batch_tokens, requests)
    assert ample.s.num_preemptions == 0
    assert tight.outputs == ample.outputs
    for i, (_, max_tokens, _) in enumerate(requests):
        assert len(tight.outputs[f"q{i}"]) == max_tokens
        assert tight.finished[f"q{i}"] == FinishReason.LENGTH
