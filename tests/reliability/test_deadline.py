"""A short client deadline on a long generation.

Criteria: the client gets DEADLINE_EXCEEDED mid-stream (some tokens, far from max_tokens),
the request then leaves the engine (gone from ListRequests) and takes no further steps (the
next request's steps are all the engine counts afterwards), and its KV blocks return to the
pool. Directly on gpu_service and through the router (which relays with no deadline of its
own towards the engine and must abort there when its client's deadline passes). Order and
outcome only; the waits are hang guards.
"""

from __future__ import annotations

import grpc
import pytest

from tests.reliability.conftest import (
    EngineStream,
    RouterStream,
    prompt_for,
)
from tests.reliability.system_specs import SLOW_GPU
from tests.helpers import wait_for

MAX_TOKENS = 400  # about 12 s of steps: far past the deadline
DEADLINE_S = 2.0
HANG_GUARD_S = 120.0
NEXT_MAX_TOKENS = 3  # the next request: one prefill step, then one decode step per further token


SYSTEM = SLOW_GPU  # shared with the other modules that leave it idle


@pytest.mark.parametrize("path", ["engine", "router"])
def test_deadline_exceeded_stops_the_request_and_frees_its_kv(system, path):
    probe, router = system.probes["gpu"], system.stub
    assert probe.wait_idle().kv_blocks_used == 0
    request_id = f"deadline-{path}"
    if path == "engine":
        stream = EngineStream.run(probe.stub, request_id, prompt_for(1), MAX_TOKENS, timeout_s=DEADLINE_S)
    else:
        stream = RouterStream.run(router, request_id, prompt_for(1), MAX_TOKENS, timeout_s=DEADLINE_S)
    assert stream.wait(HANG_GUARD_S)
    assert stream.code == grpc.StatusCode.DEADLINE_EXCEEDED, stream.error
    assert 0 < len(stream.tokens) < MAX_TOKENS

    held = wait_for(probe.requests, lambda requests: request_id not in requests, timeout_s=HANG_GUARD_S)
    assert request_id not in held, f"the engine still holds the request: {held[request_id]}"
    load = probe.wait_idle(HANG_GUARD_S)
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    # No further steps for it: a next request alone accounts for every step the engine takes.
    steps = load.num_iterations
    after = EngineStream.run(probe.stub, f"after-{request_id}", prompt_for(2), NEXT_MAX_TOKENS)
    assert after.wait(HANG_GUARD_S) and after.error is None and len(after.tokens) == NEXT_MAX_TOKENS
    assert probe.wait_idle(HANG_GUARD_S).num_iterations - steps == NEXT_MAX_TOKENS, \
        "the engine stepped for more than the next request"
