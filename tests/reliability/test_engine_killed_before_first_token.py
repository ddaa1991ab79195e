"""The engine dies before the request's first token.

gpu_service runs every step slowed to STEP_DELAY_MS (a test-only fault), so the request's
prefill is still running when the engine is SIGKILLed. Criteria: the router retries on the
surviving engine (cpu_service prefills it locally) and the client sees one clean stream:
no error, every token from the survivor, exactly the solo greedy output with its count, and
the survivor idle and leak-free afterwards.
"""

from __future__ import annotations

import time

import grpc
import pytest

from dualpace.sampling import FinishReason
from tests.reliability.conftest import (
    EngineProbe,
    RouterStream,
    assert_clean_exit,
    lone_gpu_behind_router,
    prompt_for,
    router_stub,
    start_all,
    start_cpu,
    start_gpu,
    start_router,
)
from tests.helpers import wait_for

STEP_DELAY_MS = 3000  # the prefill step alone takes 3 s on the GPU engine
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def system(tiny_folder):
    engines = start_all(
        gpu=lambda: start_gpu(tiny_folder, "--name", "gpu-doomed", "--kv-blocks", "128", "--block-size", "8",
                              step_delay_ms=STEP_DELAY_MS),
        cpu=lambda: start_cpu(tiny_folder, "--name", "cpu-survivor", "--kv-blocks", "256", "--block-size", "8"),
    )
    router = None
    try:
        router = start_router(tiny_folder, engines["gpu"], engines["cpu"], "--no-migrate")
        channel = grpc.insecure_channel(router.address)
        yield engines, router_stub(channel)
        channel.close()
    finally:
        engines["gpu"].kill()
        assert_clean_exit([d for d in (router, engines["cpu"]) if d is not None])


def test_router_retries_on_the_survivor_and_the_stream_is_clean(system, reference):
    engines, router = system
    gpu, cpu = EngineProbe(engines["gpu"].address), EngineProbe(engines["cpu"].address)
    prompt = prompt_for(4, 10)
    stream = RouterStream.run(router, "before-first", prompt, MAX_TOKENS)
    held = wait_for(gpu.requests, lambda requests: "before-first" in requests, timeout_s=10)
    assert "before-first" in held, "the request never reached the GPU engine"
    assert held["before-first"].generated_tokens == 0
    assert not stream.tokens and not stream.done.is_set(), "the first token came before the kill"
    engines["gpu"].kill()

    assert stream.wait(120)
    assert stream.error is None, (stream.error, engines["cpu"].log()[-3000:])
    assert stream.finish_reason == FinishReason.LENGTH
    assert len(stream.tokens) == MAX_TOKENS
    assert stream.tokens == reference(prompt, MAX_TOKENS)
    assert stream.engines == {"cpu-survivor"}
    load = cpu.wait_idle()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
    assert cpu.requests() == {}
    gpu.close()
    cpu.close()


@pytest.fixture
def lone_engine(tiny_folder):
    with lone_gpu_behind_router(tiny_folder, "gpu-lone-slow", STEP_DELAY_MS) as pair:
        yield pair


def test_no_survivor_before_the_first_token_is_unavailable_at_once(lone_engine):
    """Nothing was streamed yet and no engine is up: the request is refused like a new one
    (UNAVAILABLE at once), not held until some engine comes back."""
    gpu, router = lone_engine
    probe = EngineProbe(gpu.address)
    stream = RouterStream.run(router, "lone-before-first", prompt_for(2), MAX_TOKENS, timeout_s=60)
    held = wait_for(probe.requests, lambda requests: "lone-before-first" in requests, timeout_s=10)
    assert "lone-before-first" in held and not stream.tokens
    probe.close()
    killed = time.monotonic()
    gpu.kill()
    assert stream.wait(30)
    assert stream.code == grpc.StatusCode.UNAVAILABLE, stream.error
    assert time.monotonic() - killed < 5.0
    assert not stream.tokens
