"""Cancel a stream after N tokens while 20 others run.

Criteria: the cancelled request leaves the engine within one step (it disappears from
ListRequests by the engine's next step boundary, counted with the load snapshot's
num_iterations), the KV pool returns to its baseline when everything is done, the same
request id can be used again, and the 20 others finish with exactly max_tokens tokens
equal to their solo greedy runs. Directly on gpu_service (the stream's cancellation
aborts the request) and through the router (it aborts in the engine explicitly). Every
engine step lasts at least SLOW_STEP_DELAY_MS (a test-only fault), so "one step" is measurable.
"""

from __future__ import annotations

import grpc
import pytest

from dualpace.sampling import FinishReason
from tests.reliability.conftest import (
    EngineStream,
    RouterStream,
    prompt_for,
)
from tests.reliability.system_specs import SLOW_GPU
from tests.helpers import wait_for

NUM_OTHERS = 20
OTHER_MAX_TOKENS = 24
VICTIM_MAX_TOKENS = 400
CANCEL_AFTER_TOKENS = 5
# The step running when the cancel arrives finishes; the abort applies at the boundary after
# it. One more step of slack for the cancellation to cross the wire on a loaded machine.
MAX_STEPS_TO_FREE = 2


SYSTEM = SLOW_GPU  # shared with the other modules that leave it idle


@pytest.mark.parametrize("path", ["engine", "router"])
def test_cancel_frees_within_one_step_and_others_finish_exactly(system, reference, path):
    probe, router = system.probes["gpu"], system.stub
    baseline = probe.wait_idle().kv_blocks_used
    assert baseline == 0

    def start(request_id: str, prompt: list[int], max_tokens: int):
        if path == "engine":
            return EngineStream.run(probe.stub, request_id, prompt, max_tokens)
        return RouterStream.run(router, request_id, prompt, max_tokens)

    victim_id = f"victim-{path}"
    others = {f"other-{path}-{i}": prompt_for(i) for i in range(NUM_OTHERS)}
    streams = {rid: start(rid, prompt, OTHER_MAX_TOKENS) for rid, prompt in others.items()}
    victim = start(victim_id, prompt_for(99), VICTIM_MAX_TOKENS)
    try:
        assert victim.wait_tokens(CANCEL_AFTER_TOKENS), (victim.error, victim.tokens)
        listed = probe.requests()
        assert victim_id in listed and listed[victim_id].kv_blocks > 0
        steps_at_cancel = probe.load().num_iterations
        victim.cancel()
        # Each poll reads the step count, then the request table: when the table first lacks the
        # request, the count read just before it bounds the step at which it left (a slow test
        # process between the two reads must not look like a slow abort).
        steps_when_gone, gone = wait_for(lambda: (probe.load().num_iterations, probe.requests()),
                                         lambda polled: victim_id not in polled[1], timeout_s=10, interval_s=0.002)
        assert victim_id not in gone, "the cancelled request is still held by the engine"
        assert steps_when_gone - steps_at_cancel <= MAX_STEPS_TO_FREE, \
            f"freed after {steps_when_gone - steps_at_cancel} steps"
        assert victim.wait(30) and victim.code == grpc.StatusCode.CANCELLED
        assert len(victim.tokens) < VICTIM_MAX_TOKENS

        for rid, stream in streams.items():
            assert stream.wait(), f"{rid} did not finish"
        for rid, stream in streams.items():
            assert stream.error is None, (rid, stream.error)
            assert not stream.problems, (rid, stream.problems)
            assert stream.finish_reason == FinishReason.LENGTH, rid
            assert len(stream.tokens) == OTHER_MAX_TOKENS, rid
            assert stream.tokens == reference(others[rid], OTHER_MAX_TOKENS), rid
    finally:
        for stream in (*streams.values(), victim):
            if not stream.done.is_set():
                stream.cancel()

    assert probe.wait_idle().kv_blocks_used == baseline
    assert probe.requests() == {}

    # The id is free again: a new request under it runs to its end.
    again = start(victim_id, prompt_for(7), 5)
    assert again.wait(60) and again.error is None, again.error
    assert again.finish_reason == FinishReason.LENGTH and again.tokens == reference(prompt_for(7), 5)
    assert probe.wait_idle().kv_blocks_used == baseline
