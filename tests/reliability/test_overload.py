"""Capacity + K concurrent requests.

How capacity is bounded:
- an engine holds at most --max-running requests in its step loop and --max-waiting in its
  queue; the next new request is refused at once with RESOURCE_EXHAUSTED;
- the router admits a request when an engine has KV room for prompt + max_tokens (beyond a
  10% reserve once the engine holds something); otherwise the request waits in the
  router's bounded queue for at most --ttft-target-ms, then gets RESOURCE_EXHAUSTED.

Criteria: exactly the K extra requests get RESOURCE_EXHAUSTED, with no token, while the
capacity is taken (every refusal ends before any admitted request does; on the engine, naming
its queue; through the router, after its bounded wait, saying so), every admitted request
finishes with exactly max_tokens tokens, and nothing leaks (no KV block, no held request,
afterwards). Order and outcome only: the waits are hang guards, not timing criteria.
"""

from __future__ import annotations

import grpc

from dualpace.sampling import FinishReason
from dualpace.wire.v1 import router_pb2
from tests.reliability.conftest import (
    EngineStream,
    RouterStream,
    prompt_for,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec
from tests.helpers import wait_for

STEP_DELAY_MS = 30
K = 4
# Engine: 2 running + 2 waiting.
MAX_RUNNING, MAX_WAITING = 2, 2
ENGINE_MAX_TOKENS = 40  # admitted requests last >= 1.2 s, far past the refusals
# Router: GPU pool of 24 blocks of 8 tokens; a request of 8 + 56 tokens takes 8 blocks, so
# two fit (the second within the 3-block reserve) and a third must wait.
ROUTER_CAPACITY = 2
ROUTER_PROMPT_TOKENS, ROUTER_MAX_TOKENS = 8, 56
ROUTER_WAIT_MS = 500
HANG_GUARD_S = 120.0


# The reserve rule counts each placed request at its final size, so the router itself runs out
# of room (and its bounded wait is what is tested); gpu-only's default, optimistic admission,
# would admit them all and leave the engine to preempt (tests/policy/test_gpu_admission.py).
SYSTEM = SystemSpec(
    engines=(
        EngineSpec("limited", "gpu", ("--name", "gpu-limited", "--max-running", str(MAX_RUNNING),
                                      "--max-waiting", str(MAX_WAITING)),
                   step_delay_ms=STEP_DELAY_MS, behind_router=False),
        EngineSpec("small", "gpu", ("--name", "gpu-small-pool", "--kv-blocks", "24", "--block-size", "8"),
                   step_delay_ms=STEP_DELAY_MS),
    ),
    router_flags=("--policy", "gpu-only", "--no-migrate", "--gpu-admission", "reserve",
                  "--ttft-target-ms", str(ROUTER_WAIT_MS)))


def split(streams: dict[str, object]) -> tuple[list[str], list[str]]:
    refused = sorted(rid for rid, s in streams.items() if s.code == grpc.StatusCode.RESOURCE_EXHAUSTED)
    others = sorted(rid for rid in streams if rid not in refused)
    return refused, others


def test_engine_refuses_the_extra_requests_at_once(system, reference):
    probes = system.probes
    probe = probes["limited"]
    assert probe.wait_idle().kv_blocks_used == 0
    capacity = MAX_RUNNING + MAX_WAITING
    admitted = {}
    # The queue bound counts requests not yet stepped: fill the step loop first, then the queue.
    for i in range(capacity):
        admitted[f"cap-{i}"] = EngineStream.run(probe.stub, f"cap-{i}", prompt_for(i), ENGINE_MAX_TOKENS)
        if i == MAX_RUNNING - 1:
            assert wait_for(probe.load, lambda s: s.num_running == MAX_RUNNING, timeout_s=10).num_running == MAX_RUNNING
    load = wait_for(probe.load, lambda s: s.num_running + s.num_waiting == capacity, timeout_s=10)
    assert (load.num_running, load.num_waiting) == (MAX_RUNNING, MAX_WAITING)

    extra = {f"extra-{i}": EngineStream.run(probe.stub, f"extra-{i}", prompt_for(50 + i), ENGINE_MAX_TOKENS)
             for i in range(K)}
    for rid, stream in extra.items():
        assert stream.wait(HANG_GUARD_S), rid
        assert stream.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (rid, stream.error)
        assert "queue" in stream.error.details()
        assert not stream.tokens
    assert not any(s.done.is_set() for s in admitted.values()), "an admitted request ended before the refusals"

    for rid, stream in admitted.items():
        assert stream.wait(), rid
        assert stream.error is None, (rid, stream.error)
        assert stream.finish_reason == FinishReason.LENGTH and len(stream.tokens) == ENGINE_MAX_TOKENS, rid
        assert stream.tokens == reference(prompt_for(int(rid.split("-")[1])), ENGINE_MAX_TOKENS), rid
    load = probe.wait_idle()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    assert probe.requests() == {}
    # Room again: the refused ids are not remembered.
    again = EngineStream.run(probe.stub, "extra-0", prompt_for(3), 3)
    assert again.wait(HANG_GUARD_S) and again.error is None and len(again.tokens) == 3


def test_router_refuses_the_extra_requests_after_its_bounded_wait(system, reference):
    probes, router = system.probes, system.stub
    probe = probes["small"]
    assert probe.wait_idle().kv_blocks_used == 0
    prompts = {f"r-{i}": prompt_for(i, ROUTER_PROMPT_TOKENS) for i in range(ROUTER_CAPACITY + K)}
    streams = {rid: RouterStream.run(router, rid, prompt, ROUTER_MAX_TOKENS) for rid, prompt in prompts.items()}
    for stream in streams.values():
        assert stream.wait(HANG_GUARD_S), stream.request_id
    refused, admitted = split(streams)
    assert len(refused) == K, {rid: (s.code, len(s.tokens)) for rid, s in streams.items()}
    for rid in refused:
        stream = streams[rid]
        assert not stream.tokens, rid
        assert f"no engine had room within {ROUTER_WAIT_MS / 1e3:g} s" in stream.error.details(), rid
    for rid in admitted:
        stream = streams[rid]
        assert stream.error is None, (rid, stream.error)
        assert stream.finish_reason == FinishReason.LENGTH, rid
        assert stream.tokens == reference(prompts[rid], ROUTER_MAX_TOKENS), rid
        # They outlived the refusals: the extra ones were refused while capacity was taken.
        assert stream.ended_s > max(streams[r].ended_s for r in refused), rid
    load = probe.wait_idle()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    assert probe.requests() == {}
    # No router-side leak either: nothing placed, and a new request is admitted and completes.
    assert not router.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10).requests
    after = RouterStream.run(router, "r-after", prompt_for(9), 3)
    assert after.wait(HANG_GUARD_S) and after.error is None and len(after.tokens) == 3
    assert after.tokens == reference(prompt_for(9), 3)
