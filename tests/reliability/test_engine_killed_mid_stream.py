"""An engine dies mid-stream.

gpu_service and cpu_service with every step slowed (a test-only fault) and no load-driven
migration, so requests stay where admission (and the hand-off) put them. After every stream
has produced tokens one engine is SIGKILLed. Criteria: every request continues on the
survivor and its client stream equals the solo greedy run (no duplicated or missing
token, exactly max_tokens tokens, no error), and the survivor ends with no KV block held.
"""

from __future__ import annotations

import grpc
import pytest

from dualpace.sampling import FinishReason
from dualpace.wire.v1 import router_pb2
from tests.reliability.conftest import (
    EngineProbe,
    RouterStream,
    prompt_for,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec, lone_gpu

STEP_DELAY_MS = 10
NUM_REQUESTS = 6
MAX_TOKENS = 150
TOKENS_BEFORE_KILL = 5
NAMES = {"gpu": "gpu-mid", "cpu": "cpu-mid"}


SYSTEM = SystemSpec(engines=(
    EngineSpec("gpu", "gpu", ("--name", NAMES["gpu"], "--block-size", "8", "--kv-blocks", "48"),
               step_delay_ms=STEP_DELAY_MS),
    EngineSpec("cpu", "cpu", ("--name", NAMES["cpu"], "--block-size", "8", "--kv-blocks", "1024"),
               step_delay_ms=STEP_DELAY_MS),
))


@pytest.mark.parametrize("victim", ["gpu", "cpu"])
def test_streams_continue_on_the_survivor_exactly(fresh_system, reference, victim):
    engines, router = fresh_system.engines, fresh_system.stub
    survivor = "cpu" if victim == "gpu" else "gpu"
    prompts = {f"mid-{i}": prompt_for(i, 3 + i) for i in range(NUM_REQUESTS)}
    streams = {rid: RouterStream.run(router, rid, prompt, MAX_TOKENS) for rid, prompt in prompts.items()}
    try:
        for rid, stream in streams.items():
            assert stream.wait_tokens(TOKENS_BEFORE_KILL), (rid, stream.error)
        placed = router.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10).requests
        on_victim = {r.request_id for r in placed if r.engine == NAMES[victim]}
        assert on_victim, "no request was on the engine when it died"
        assert not any(s.done.is_set() for s in streams.values()), "a request ended before the kill"
        engines[victim].kill()
        for rid, stream in streams.items():
            assert stream.wait(), rid
    finally:
        for stream in streams.values():
            if not stream.done.is_set():
                stream.cancel()
    for rid, stream in streams.items():
        assert stream.error is None, (rid, stream.error)
        assert stream.finish_reason == FinishReason.LENGTH, rid
        assert len(stream.tokens) == MAX_TOKENS, rid
        assert stream.tokens == reference(prompts[rid], MAX_TOKENS), rid
    for rid in on_victim:
        assert NAMES[survivor] in streams[rid].engines, rid
    probe = EngineProbe(engines[survivor].address)
    load = probe.wait_idle()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    probe.close()


CLIENT_DEADLINE_S = 3.0  # the router gives up 0.25 s before it (router/relay.py, DEADLINE_MARGIN_S)


@pytest.mark.parametrize("fresh_system", [lone_gpu("gpu-lone", STEP_DELAY_MS)], ids=["lone-gpu"], indirect=True)
def test_no_survivor_is_unavailable_within_the_client_deadline(fresh_system):
    """Nothing else can take the request and its engine does not come back: the client gets
    UNAVAILABLE before its own deadline (not DEADLINE_EXCEEDED), with the tokens it already had
    and none repeated."""
    gpu, router = fresh_system.engines["gpu"], fresh_system.stub
    stream = RouterStream.run(router, "lone", prompt_for(1), MAX_TOKENS, timeout_s=CLIENT_DEADLINE_S)
    assert stream.wait_tokens(TOKENS_BEFORE_KILL), stream.error
    gpu.kill()
    assert stream.wait(CLIENT_DEADLINE_S + 5)
    # The router's own answer before the client's deadline (past it, gRPC would end the call
    # DEADLINE_EXCEEDED): its recovery gave up in time, saying why.
    assert stream.code == grpc.StatusCode.UNAVAILABLE, stream.error
    assert stream.error.details().startswith("request lone waited for engine gpu-lone at "), stream.error.details()
    assert stream.error.details().endswith("did not come back before the client's deadline"), stream.error.details()
    assert 0 < len(stream.tokens) < MAX_TOKENS
