"""Issue #9, item 2: a short client deadline on a long generation.

Criteria: the client gets DEADLINE_EXCEEDED near its deadline, the request then leaves the
engine (gone from ListRequests) and takes no further steps, and its KV blocks return to the
pool. Directly on gpu_service and through the router (which relays with no deadline of its
own towards the engine and must abort there when its client's deadline passes).
"""

from __future__ import annotations

import time

import grpc
import pytest

from tests.reliability.conftest import (
    SLOW_STEP_DELAY_MS,
    EngineStream,
    RouterStream,
    prompt_for,
    wait_for,
)

STEP_DELAY_MS = SLOW_STEP_DELAY_MS
MAX_TOKENS = 400  # about 12 s of steps: far past the deadline
DEADLINE_S = 1.0


@pytest.fixture(scope="module")
def system(slow_gpu_behind_router):
    return slow_gpu_behind_router


@pytest.mark.parametrize("path", ["engine", "router"])
def test_deadline_exceeded_stops_the_request_and_frees_its_kv(system, path):
    probe, router = system
    assert probe.wait_idle().kv_blocks_used == 0
    request_id = f"deadline-{path}"
    if path == "engine":
        stream = EngineStream.run(probe.stub, request_id, prompt_for(1), MAX_TOKENS, timeout_s=DEADLINE_S)
    else:
        stream = RouterStream.run(router, request_id, prompt_for(1), MAX_TOKENS, timeout_s=DEADLINE_S)
    assert stream.first_token.wait(DEADLINE_S + 5)
    assert stream.wait(DEADLINE_S + 10)
    assert stream.code == grpc.StatusCode.DEADLINE_EXCEEDED, stream.error
    assert stream.ended_s - stream.started_s < DEADLINE_S + 2.0
    assert 0 < len(stream.tokens) < MAX_TOKENS

    held = wait_for(probe.requests, lambda requests: request_id not in requests, timeout_s=5)
    assert request_id not in held, f"the engine still holds the request: {held[request_id]}"
    # No further steps for it: the engine is idle, and stays so (nothing else runs).
    load = probe.wait_idle(5)
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    steps = load.num_iterations
    time.sleep(5 * STEP_DELAY_MS / 1e3)
    assert probe.load().num_iterations == steps, "the engine kept stepping after the request ended"
