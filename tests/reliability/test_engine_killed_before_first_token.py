"""The engine dies before the request's first token.

gpu_service runs every step slowed to STEP_DELAY_MS (a test-only fault), so the request's
prefill is still running when the engine is SIGKILLed. Criteria: the router retries on the
surviving engine (cpu_service prefills it locally) and the client sees one clean stream:
no error, every token from the survivor, exactly the solo greedy output with its count, and
the survivor idle and leak-free afterwards.
"""

from __future__ import annotations

import grpc
import pytest

from dualpace.sampling import FinishReason
from tests.reliability.conftest import (
    EngineProbe,
    RouterStream,
    prompt_for,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec, lone_gpu
from tests.helpers import wait_for

STEP_DELAY_MS = 3000  # the prefill step alone takes 3 s on the GPU engine
MAX_TOKENS = 24


SYSTEM = SystemSpec(engines=(
    EngineSpec("gpu", "gpu", ("--name", "gpu-doomed", "--kv-blocks", "128", "--block-size", "8"),
               step_delay_ms=STEP_DELAY_MS),
    EngineSpec("cpu", "cpu", ("--name", "cpu-survivor", "--kv-blocks", "256", "--block-size", "8")),
))


def test_router_retries_on_the_survivor_and_the_stream_is_clean(system, reference):
    engines, router = system.engines, system.stub
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


@pytest.mark.parametrize("fresh_system", [lone_gpu("gpu-lone-slow", STEP_DELAY_MS)], ids=["lone-gpu"], indirect=True)
def test_no_survivor_before_the_first_token_is_unavailable_at_once(fresh_system):
    """Nothing was streamed yet and no engine is up: the request is refused like a new one
    (UNAVAILABLE at once), not held until some engine comes back."""
    gpu, router = fresh_system.engines["gpu"], fresh_system.stub
    probe = EngineProbe(gpu.address)
    stream = RouterStream.run(router, "lone-before-first", prompt_for(2), MAX_TOKENS, timeout_s=60)
    held = wait_for(probe.requests, lambda requests: "lone-before-first" in requests, timeout_s=10)
    assert "lone-before-first" in held and not stream.tokens
    probe.close()
    gpu.kill()
    assert stream.wait(30)
    # Re-admitted as a new request and refused by admission itself (no engine is up), not by a
    # recovery that waits for its engine to come back ("request ... waited for engine ...").
    assert stream.code == grpc.StatusCode.UNAVAILABLE, stream.error
    assert stream.error.details() == "no engine is available", stream.error.details()
    assert not stream.tokens
