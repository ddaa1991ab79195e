"""The scheduler with prefix caching, driven by a fake model that keeps its "KV" in slots.

The fake model stores the token of each position in the flat slot the plan's block
table gives it and, to sample, reads the whole context back through the block table:
the token drawn is a hash of what the slots hold. So a matched block holding other
tokens than its hash claims, a prefill that skips tokens that were not cached, or a
cached block handed out while another request still reads it, changes the outputs.
Outputs must be identical with caching on and off.
"""

from __future__ import annotations

import random
import zlib

from dualpace.engine.request import EngineRequest
from dualpace.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.sampling import SamplingParams

BLOCK_SIZE = 4


class SlotModel:
    def __init__(self, scheduler: Scheduler):
        self.s = scheduler
        self.slots: dict[int, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.num_prefill_tokens = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.s.add(EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=1))
        self.outputs[request_id] = []

    def step(self) -> None:
        plan = self.s.schedule()
        sampled = {}
        for seq in plan.sequences:
            for offset, token in enumerate(seq.token_ids):
                position = seq.start_pos + offset
                self.slots[seq.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE] = token
            if len(seq.token_ids) > 1:
                self.num_prefill_tokens += len(seq.token_ids)
            if seq.sample:
                context = [self.slots[seq.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE]
                           for p in range(seq.sample_position)]
                sampled[seq.request_id] = 100 + zlib.crc32(repr(context).encode()) % 900
        for event in self.s.apply(plan, StepResult(sampled)):
            self.outputs[event.request_id].extend(event.new_token_ids)

    def run(self) -> None:
        for _ in range(10_000):
            if not self.s.has_work:
                return
            self.step()
        raise AssertionError("did not finish")


def make(num_blocks: int, caching: bool, max_batch_tokens: int = 64) -> SlotModel:
    hasher = BlockHasher(BLOCK_SIZE, "fake") if caching else None
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=max_batch_tokens), num_blocks, BLOCK_SIZE, 4096,
                          block_hasher=hasher)
    return SlotModel(scheduler)


def test_a_shared_prefix_is_computed_once_and_outputs_match():
    system = list(range(10, 30))  # 20 tokens: 5 full blocks
    results = {}
    for caching in (False, True):
        model = make(64, caching)
        model.add("first", system + [1, 2], 6)
        model.run()
        model.add("second", system + [3, 4, 5], 6)
        model.run()
        results[caching] = (model.outputs, model.num_prefill_tokens, model.s)
    assert results[True][0] == results[False][0]
    scheduler = results[True][2]
    assert scheduler.num_prefix_hit_tokens == 20
    assert scheduler.num_prefix_query_tokens == 22 + 23
    assert results[False][1] - results[True][1] == 20  # the second prefill started after the shared blocks
    assert scheduler.blocks.num_used_blocks == 0 and scheduler.blocks.num_cached_blocks > 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    model = make(64, True)
    prompt = list(range(10, 26))  # exactly 4 full blocks
    model.add("a", prompt, 3)
    model.run()
    model.add("b", prompt, 3)
    plan = model.s.schedule()
    (seq,) = plan.sequences
    assert seq.start_pos == 12 and seq.sample  # three blocks reused, the last block recomputed
    assert model.s.get("b").num_cached_tokens == 12


def test_decode_blocks_are_cached_so_a_resent_conversation_hits_them():
    model = make(64, True)
    model.add("turn1", [5] * 6, 10)
    model.run()
    history = [5] * 6 + model.outputs["turn1"]  # 16 tokens; the last one's KV was never computed
    model.add("turn2", history + [7, 7], 4)
    model.run()
    assert model.s.num_prefix_hit_tokens == 12  # 15 computed tokens: 3 full blocks


def test_under_a_small_pool_every_request_completes_identically_and_blocks_return():
    rng = random.Random(19)
    system = [rng.randrange(10, 90) for _ in range(12)]
    prompts = [system + [rng.randrange(10, 90) for _ in range(rng.randrange(1, 9))] for _ in range(12)]
    outputs = {}
    for caching in (False, True):
        model = make(14, caching, max_batch_tokens=16)  # far too small for 12 requests at once
        for index, prompt in enumerate(prompts):
            model.add(f"r{index}", prompt, 8)
        model.run()
        outputs[caching] = model.outputs
        blocks = model.s.blocks
        assert blocks.num_used_blocks == 0
        assert blocks.num_free_blocks + blocks.num_cached_blocks == blocks.num_total_blocks
        if caching:
            assert model.s.num_preemptions > 0 and model.s.num_prefix_hit_tokens > 0
    assert outputs[True] == outputs[False]


def test_cached_blocks_are_evicted_before_a_running_request_is_preempted():
    model = make(8, True)
    model.add("old", list(range(10, 30)), 1)  # 5 full blocks left cached
    model.run()
    assert model.s.blocks.num_cached_blocks == 5
    model.add("new", list(range(40, 50)), 18)  # grows to 7 blocks: needs evictions, no preemption
    model.run()
    assert model.s.num_preemptions == 0
    assert model.s.blocks.num_evictions >= 4


def test_abort_and_preemption_leave_no_used_blocks():
    model = make(32, True)
    model.add("a", list(range(10, 22)), 8)
    model.step()
    model.s.abort("a")
    assert model.s.blocks.num_used_blocks == 0
    assert model.s.blocks.num_cached_blocks == 3  # its computed full blocks stay cached
    model.add("b", list(range(10, 22)), 2)
    model.run()
    assert model.s.num_prefix_hit_tokens == 8  # all but the last token, in whole blocks


def test_an_imported_request_enters_the_cache_after_its_first_step_here():
    # The commit is on the source's path, so it hashes nothing: the imported blocks are cached with
    # the request's first step here, and then serve a request with the same prefix.
    model = make(64, True)
    prompt = list(range(40, 52))  # 12 tokens: their KV arrives with the import, 3 full blocks
    imported = EngineRequest("imp", prompt, SamplingParams(max_tokens=3, ignore_eos=True), seed=1,
                             output_token_ids=[7])
    model.outputs["imp"] = []
    block_ids = model.s.reserve_import("imp", len(prompt))
    for position, token in enumerate(prompt):  # what the source wrote into the reserved blocks
        model.slots[block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE] = token
    model.s.commit_import(imported)
    assert imported.block_hashes == []
    model.step()
    assert len(imported.block_hashes) == 3
    model.run()
    model.add("same-prefix", prompt + [1], 2)
    model.run()
    assert model.s.num_prefix_hit_tokens == 12
