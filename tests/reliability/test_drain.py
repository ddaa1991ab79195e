"""Graceful drain under load (SIGTERM).

Criteria, for the engine and for the router: once SIGTERM arrives, health says NOT_SERVING
(the router's for its whole drain), new requests are refused with UNAVAILABLE saying it is
shutting down, every in-flight request completes (exactly max_tokens tokens, its solo greedy
output), and the process exits 0. Past --grace-s: tests/serve/test_graceful_shutdown.py. Engine steps are slowed (a test-only fault) so the
requests are reliably mid-stream when the signal arrives.
"""

from __future__ import annotations

import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dualpace.sampling import FinishReason
from tests.reliability.conftest import (
    EngineProbe,
    EngineStream,
    RouterStream,
    prompt_for,
    router_stub,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec
from tests.helpers import wait_for

STEP_DELAY_MS = 30
NUM_IN_FLIGHT = 4
MAX_TOKENS = 60  # about 2 s of steps: still running when the refusals are tested
EXIT_TIMEOUT_S = 30


SYSTEM = SystemSpec(
    engines=(EngineSpec("gpu", "gpu", ("--name", "gpu-drain", "--kv-blocks", "128", "--block-size", "8"),
                        step_delay_ms=STEP_DELAY_MS),),
    router_flags=("--policy", "gpu-only", "--no-migrate"))


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def assert_completed(streams, prompts, reference) -> None:
    for rid, stream in streams.items():
        assert stream.wait(60), rid
    for rid, stream in streams.items():
        assert stream.error is None, (rid, stream.error)
        assert stream.finish_reason == FinishReason.LENGTH and len(stream.tokens) == MAX_TOKENS, rid
        assert stream.tokens == reference(prompts[rid], MAX_TOKENS), rid


def test_engine_drains_direct_and_relayed_requests(fresh_system, reference):
    gpu, router_daemon = fresh_system.engines["gpu"], fresh_system.router
    probe = EngineProbe(gpu.address)
    with grpc.insecure_channel(router_daemon.address) as channel:
        router = router_stub(channel)
        prompts = {f"e-direct-{i}": prompt_for(i) for i in range(NUM_IN_FLIGHT)}
        prompts |= {f"e-relayed-{i}": prompt_for(20 + i) for i in range(NUM_IN_FLIGHT)}
        streams = {rid: (EngineStream.run(probe.stub, rid, p, MAX_TOKENS) if "direct" in rid
                         else RouterStream.run(router, rid, p, MAX_TOKENS)) for rid, p in prompts.items()}
        for rid, stream in streams.items():
            assert stream.wait_tokens(1), (rid, stream.error)
        gpu.process.send_signal(signal.SIGTERM)
        # The signal is handled asynchronously: a request sent before health says NOT_SERVING
        # would be a request sent before the drain.
        status = wait_for(probe.health, lambda s: s == health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=5)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING

        late = EngineStream.run(probe.stub, "e-late-direct", prompt_for(40), 2)
        assert late.wait(10) and late.code == grpc.StatusCode.UNAVAILABLE, late.error
        assert "shutting down" in late.error.details(), late.error
        # The router sees the engine draining (its load stream says not serving, or the engine
        # refuses): the request is refused as UNAVAILABLE, not queued or lost.
        late_relayed = RouterStream.run(router, "e-late-relayed", prompt_for(41), 2, timeout_s=30)
        assert late_relayed.wait(35) and late_relayed.code == grpc.StatusCode.UNAVAILABLE, late_relayed.error
        assert not any(s.done.is_set() for s in streams.values()), "a request ended before the refusals"
        assert_completed(streams, prompts, reference)
    assert gpu.process.wait(EXIT_TIMEOUT_S) == 0, gpu.log()[-3000:]
    assert "drained" in gpu.log()
    probe.close()


def test_router_drains_relayed_requests(fresh_system, reference):
    gpu, router_daemon = fresh_system.engines["gpu"], fresh_system.router
    probe = EngineProbe(gpu.address)
    with grpc.insecure_channel(router_daemon.address) as channel:
        router = router_stub(channel)
        prompts = {f"r-{i}": prompt_for(i) for i in range(NUM_IN_FLIGHT)}
        streams = {rid: RouterStream.run(router, rid, p, MAX_TOKENS) for rid, p in prompts.items()}
        for rid, stream in streams.items():
            assert stream.wait_tokens(1), (rid, stream.error)
        router_daemon.process.send_signal(signal.SIGTERM)
        # The signal is handled asynchronously: a request sent before the router flips its
        # health would be a request sent before the drain.
        status = wait_for(lambda: health(channel), lambda s: s == health_pb2.HealthCheckResponse.NOT_SERVING,
                          timeout_s=5)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        # The whole drain long (not only at its start), new requests are refused and health answers
        # NOT_SERVING; each check after another token of the relayed streams.
        watched = streams["r-0"]
        for check in range(3):
            late = RouterStream.run(router, f"r-late-{check}", prompt_for(40), 2, timeout_s=10)
            assert late.wait(15) and late.code == grpc.StatusCode.UNAVAILABLE, late.error
            assert "shutting down" in late.error.details(), late.error
            assert health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            num_tokens = len(watched.tokens)
            assert watched.wait_tokens(num_tokens + 1), watched.error
        assert not any(s.done.is_set() for s in streams.values()), "a request ended before the refusals"
        assert_completed(streams, prompts, reference)
    assert router_daemon.process.wait(EXIT_TIMEOUT_S) == 0, router_daemon.log()[-3000:]
    # The engine kept nothing for the drained router's requests.
    load = probe.wait_idle()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    probe.close()
