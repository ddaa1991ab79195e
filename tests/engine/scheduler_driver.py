"""The fake model and driver of the scheduler tests (test_scheduler*.py).

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

from dualpace.engine.request import EngineRequest, RequestEvent
from dualpace.engine.scheduler import Scheduler, SchedulerConfig, StepPlan, StepResult
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
