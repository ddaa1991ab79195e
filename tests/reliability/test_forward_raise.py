"""A forward pass that raises fails the whole engine.

DUALPACE_FAULT_FORWARD_RAISE_AT_STEP=N raises inside the runner on the N-th served step,
as a device error would. Criteria: every stream on that engine ends with UNAVAILABLE
(tokens made before it delivered first), health turns NOT_SERVING, new requests get
UNAVAILABLE, and the process exits with status 1. Through the router with both engines,
the requests that were on the dead engine continue on the survivor (greedy outputs
identical to solo runs, or at worst an explicit error) and new requests run there.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2

from dualpace.sampling import FinishReason
from tests.reliability.conftest import (
    EngineProbe,
    EngineStream,
    RouterStream,
    assert_clean_exit,
    prompt_for,
    router_stub,
    start_all,
    start_cpu,
    start_gpu,
    start_router,
)

EXIT_TIMEOUT_S = 30.0
MAX_TOKENS = 40
# Slow steps: the requests are mid-stream when the chosen step comes.
STEP_DELAY_MS = 10


def raise_at(step: int) -> dict[str, str]:
    return {"DUALPACE_FAULT_FORWARD_RAISE_AT_STEP": str(step)}


def health_or_none(probe: EngineProbe) -> int | None:
    """The health status, or None once nothing answers (the process is gone)."""
    try:
        return probe.health()
    except grpc.RpcError:
        return None


def test_engine_fails_as_a_whole(tiny_folder):
    daemon = start_gpu(tiny_folder, "--name", "gpu-raise", "--kv-blocks", "64", "--block-size", "8",
                       step_delay_ms=STEP_DELAY_MS, env=raise_at(6))
    probe = EngineProbe(daemon.address)
    try:
        streams = [EngineStream.run(probe.stub, f"q{i}", prompt_for(i, 3 + i), MAX_TOKENS) for i in range(3)]
        for stream in streams:
            assert stream.wait()
        for stream in streams:
            assert stream.code == grpc.StatusCode.UNAVAILABLE, (stream.request_id, stream.error)
            assert "gpu-raise" in stream.error.details() and "fault injected" in stream.error.details()
            assert not stream.problems and len(stream.tokens) < MAX_TOKENS
        assert any(stream.tokens for stream in streams), "no request was mid-stream when the forward pass raised"

        # Until the process is gone: health NOT_SERVING, load not serving, new requests UNAVAILABLE.
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while (status := health_or_none(probe)) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "health still SERVING after the engine failed"
            time.sleep(0.02)
        assert status in (health_pb2.HealthCheckResponse.NOT_SERVING, None)
        if status is not None:
            try:
                assert not probe.load().serving
                late = EngineStream.run(probe.stub, "late", [1, 2], 2)
                assert late.wait() and late.code == grpc.StatusCode.UNAVAILABLE, late.error
            except grpc.RpcError as exc:  # the process went away meanwhile
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert daemon.process.wait(EXIT_TIMEOUT_S) == 1
        assert "engine failed: fault injected: the forward pass raised at step 6" in daemon.log(), daemon.log()
    finally:
        probe.close()
        daemon.kill()


def test_router_moves_work_to_the_surviving_engine(tiny_folder, reference):
    engines = start_all(
        gpu=lambda: start_gpu(tiny_folder, "--name", "gpu", "--kv-blocks", "64", "--block-size", "8",
                              step_delay_ms=STEP_DELAY_MS, env=raise_at(12)),
        cpu=lambda: start_cpu(tiny_folder, "--name", "cpu", "--kv-blocks", "512", "--block-size", "8"),
    )
    gpu, cpu = engines["gpu"], engines["cpu"]
    router = start_router(tiny_folder, gpu, cpu, "--no-migrate")
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = router_stub(channel)
            prompts = {f"q{i}": prompt_for(i, 3 + i) for i in range(4)}
            streams = {rid: RouterStream.run(stub, rid, prompt, MAX_TOKENS) for rid, prompt in prompts.items()}
            for stream in streams.values():
                assert stream.wait()
            assert gpu.process.wait(EXIT_TIMEOUT_S) == 1, gpu.log()

            # Every client got its whole greedy output; an error would at least have to be explicit.
            for rid, stream in streams.items():
                if stream.error is not None:
                    assert stream.code == grpc.StatusCode.UNAVAILABLE and stream.error.details(), rid
            assert all(s.error is None for s in streams.values()), {r: s.error for r, s in streams.items()}
            for rid, stream in streams.items():
                assert stream.finish_reason == FinishReason.LENGTH, rid
                assert stream.tokens == reference(prompts[rid], MAX_TOKENS), rid
            moved = [rid for rid, stream in streams.items() if stream.engines == {"gpu", "cpu"}]
            assert moved, {rid: stream.engines for rid, stream in streams.items()}

            # New requests run on the survivor.
            later = {f"new{i}": prompt_for(10 + i) for i in range(6)}
            after = {rid: RouterStream.run(stub, rid, prompt, 8) for rid, prompt in later.items()}
            for rid, stream in after.items():
                assert stream.wait()
                assert stream.error is None, (rid, stream.error)
                assert stream.tokens == reference(later[rid], 8) and stream.engines == {"cpu"}, rid
    finally:
        assert_clean_exit([router, cpu])
        gpu.kill()
