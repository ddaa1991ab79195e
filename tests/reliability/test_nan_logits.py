"""Non-finite logits end only their request.

DUALPACE_FAULT_NAN_LOGITS_REQUEST makes one request's logits NaN in a real gpu_service
(on every step that samples for it, so at its first token). Criteria: that request's
stream ends with DATA_LOSS naming it and "non-finite logits"; the requests batched with
it finish exactly as their solo greedy runs; its KV blocks come back; the engine stays
SERVING and counts it in dualpace_nonfinite_logits_total. Through the router the client
gets the same explicit error at once (not retried), and the engine is not taken for dead.
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from dualpace.sampling import FinishReason
from dualpace.wire.engine_messages import resume_request_to_pb
from tests.reliability.conftest import (
    RPC_TIMEOUT_S,
    EngineProbe,
    EngineStream,
    RouterStream,
    assert_clean_exit,
    prompt_for,
    router_stub,
    start_gpu,
    start_router,
)

ENGINE = "gpu-nan"
VICTIM = "victim"
MAX_TOKENS = 16
NUM_OTHERS = 3
# Slow steps keep the other requests decoding while the victim is prefilled beside them.
STEP_DELAY_MS = 15


@pytest.fixture(scope="module")
def engine(tiny_folder):
    daemon = start_gpu(tiny_folder, "--name", ENGINE, "--kv-blocks", "64", "--block-size", "8", "--metrics-port", "0",
                       step_delay_ms=STEP_DELAY_MS, env={"DUALPACE_FAULT_NAN_LOGITS_REQUEST": VICTIM})
    probe = EngineProbe(daemon.address)
    try:
        yield daemon, probe
    finally:
        probe.close()
        assert_clean_exit([daemon])


def scrape(daemon) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the daemon's --metrics-port."""
    match = re.search(r"gpu_service metrics on (\S+)", daemon.log())
    assert match, daemon.log()
    with urllib.request.urlopen(f"http://{match.group(1)}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def increase(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def assert_nonfinite_error(error: grpc.RpcError | None, request_id: str) -> None:
    assert error is not None, "the request did not fail"
    assert error.code() == grpc.StatusCode.DATA_LOSS, (error.code(), error.details())
    assert repr(request_id) in error.details() and "non-finite logits" in error.details(), error.details()


def test_nan_logits_end_only_that_request(engine, reference):
    daemon, probe = engine
    assert probe.blocks_used() == 0
    before = scrape(daemon)
    others = {f"r{i}": prompt_for(i, 4 + 2 * i) for i in range(NUM_OTHERS)}
    streams = {rid: EngineStream.run(probe.stub, rid, prompt, MAX_TOKENS) for rid, prompt in others.items()}
    for stream in streams.values():  # every other request is decoding before the victim arrives
        assert stream.first_token.wait(RPC_TIMEOUT_S)

    victim = EngineStream.run(probe.stub, VICTIM, [7, 8, 9, 10, 11], MAX_TOKENS)
    assert victim.wait()
    progress = {rid: len(s.tokens) for rid, s in streams.items()}
    for stream in streams.values():
        assert stream.wait()

    assert_nonfinite_error(victim.error, VICTIM)
    assert victim.tokens == []  # the NaN hits its first token
    assert any(count < MAX_TOKENS for count in progress.values()), progress  # it shared steps with them
    for rid, stream in streams.items():
        assert stream.error is None and not stream.problems, (rid, stream.error, stream.problems)
        assert stream.finish_reason == FinishReason.LENGTH
        assert stream.tokens == reference(others[rid], MAX_TOKENS), rid

    snapshot = probe.wait_idle()
    assert snapshot.kv_blocks_used == 0 and snapshot.serving
    assert probe.requests() == {}
    assert probe.health() == health_pb2.HealthCheckResponse.SERVING
    after = scrape(daemon)
    assert increase(before, after, "dualpace_nonfinite_logits_total", engine=ENGINE) == 1
    assert increase(before, after, "dualpace_requests_total", engine=ENGINE, finish_reason="error") == 1
    assert increase(before, after, "dualpace_requests_total", engine=ENGINE, finish_reason="length") == NUM_OTHERS
    assert increase(before, after, "dualpace_errors_total", code="DATA_LOSS") == 1
    probe.assert_serving_and_generates("after-nan")


def test_resuming_the_failed_request_reports_the_same_error(engine):
    """A stream that attaches later (as the router does to resume) gets the error too, not a silent end."""
    _, probe = engine
    first = EngineStream.run(probe.stub, VICTIM, [5, 6], 4)
    assert first.wait()
    assert_nonfinite_error(first.error, VICTIM)
    resumed = probe.stub.Generate(resume_request_to_pb(VICTIM, 0), timeout=RPC_TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as info:
        list(resumed)
    assert_nonfinite_error(info.value, VICTIM)
    assert probe.wait_idle().kv_blocks_used == 0


def test_router_passes_the_error_through_and_keeps_the_engine(engine, tiny_folder, reference):
    daemon, probe = engine
    router = start_router(tiny_folder, daemon, None)
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = router_stub(channel)
            victim = RouterStream.run(stub, VICTIM, [9, 8, 7], 6)
            assert victim.wait()
            # The engine's DATA_LOSS itself: passed through, not retried (a retry with no other
            # engine would end UNAVAILABLE, or DEADLINE_EXCEEDED).
            assert_nonfinite_error(victim.error, VICTIM)
            fine = RouterStream.run(stub, "fine", [4, 4, 2], 6)
            assert fine.wait()
            assert fine.error is None, fine.error
            assert fine.tokens == reference([4, 4, 2], 6) and fine.engines == {ENGINE}
        assert probe.health() == health_pb2.HealthCheckResponse.SERVING
        assert probe.wait_idle().kv_blocks_used == 0
    finally:
        assert_clean_exit([router])
