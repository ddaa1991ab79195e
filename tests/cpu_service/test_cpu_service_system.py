"""cpu_service with gpu_service as real processes: handoff after a GPU prefill, decode on the
CPU (Local and Assisted), migrations both ways, and gpu_service killed under assisted load.
Hand-offs and migrations run on both KV data planes: shared memory (--kv-transport auto; both
pools are in host memory here) and gRPC chunks (--kv-transport grpc on both engines)."""

from __future__ import annotations

import threading

import pytest

from dualpace.sampling import FinishReason, SamplingParams
from tests.cpu_service.conftest import ENGINE_FLAGS, solo
from toolkit.engine_client import EngineClient, read_until
from toolkit.processes import start_daemon


TRANSPORT_USED = {"auto": "shm", "grpc": "grpc"}  # --kv-transport -> MigrateOutResponse.transport


@pytest.fixture(scope="module", params=sorted(TRANSPORT_USED))
def gpu(request, model_folder):
    # Slowed steps (a test-only fault) so a request is still decoding when it is moved.
    daemon = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                          "--kv-transport", request.param, env={"DUALPACE_FAULT_STEP_DELAY_MS": "3"})
    daemon.kv_transport = request.param
    yield daemon
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module", params=["never", "always"])
def cpu(request, model_folder, gpu):
    daemon = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "512",
                          "--assist", request.param, "--gpu-service", gpu.address, "--kv-transport", gpu.kv_transport)
    yield request.param, daemon
    assert daemon.stop() == 0, daemon.log()
    # With a healthy gpu_service every assisted iteration must really have been assisted.
    assert "redoing it locally" not in daemon.log()
    if request.param == "always":
        assert "iterations now run assisted" in daemon.log()


def handoff(gpu_client, cpu_client, request_id, prompt, params, gpu_tokens: int = 1,
            transport: str | None = None) -> list[int]:
    """Prefill (and `gpu_tokens` tokens) on the GPU engine, migrate to the CPU engine, finish there."""
    tokens: list[int] = []
    responses = gpu_client.stream(request_id, prompt, params)
    assert read_until(responses, tokens, stop_after_tokens=gpu_tokens) is None
    migration = gpu_client.migrate(request_id, cpu_client.address)
    assert migration.target_engine == "cpu"
    assert transport is None or migration.transport == transport
    assert read_until(responses, tokens).migrated_to == cpu_client.address  # where to resume
    last = read_until(cpu_client.resume(request_id, len(tokens)), tokens)
    assert last.finish_reason == FinishReason.LENGTH
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_handoff_decodes_on_cpu_identically(loaded, gpu, cpu, temperature):
    mode, cpu_daemon = cpu
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(cpu_daemon.address)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 17, 33]
    params = SamplingParams(max_tokens=120, ignore_eos=True, temperature=temperature, seed=5)
    request_id = f"h-{mode}-{gpu.kv_transport}-{temperature}"
    tokens = handoff(gpu_client, cpu_client, request_id, prompt, params, transport=TRANSPORT_USED[gpu.kv_transport])
    assert tokens == solo(loaded, prompt, params)
    assert gpu_client.wait_idle().kv_blocks_used == 0 and cpu_client.wait_idle().kv_blocks_used == 0


def test_migrations_both_ways_mid_generation(loaded, gpu, cpu):
    mode, cpu_daemon = cpu
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(cpu_daemon.address)
    prompt = [2, 4, 6, 8, 10, 12]
    params = SamplingParams(max_tokens=300, ignore_eos=True)  # long enough to still run when moved
    request_id = f"both-{mode}-{gpu.kv_transport}"
    tokens: list[int] = []
    responses = gpu_client.stream(request_id, prompt, params)
    read_until(responses, tokens, stop_after_tokens=5)
    assert gpu_client.migrate(request_id, cpu_client.address).transport == TRANSPORT_USED[gpu.kv_transport]
    read_until(responses, tokens)
    responses = cpu_client.resume(request_id, len(tokens))
    read_until(responses, tokens, stop_after_tokens=15)
    assert cpu_client.migrate(request_id, gpu_client.address).transport == TRANSPORT_USED[gpu.kv_transport]
    assert read_until(responses, tokens).migrated_to == gpu_client.address
    assert read_until(gpu_client.resume(request_id, len(tokens)), tokens).finish_reason == FinishReason.LENGTH
    assert tokens == solo(loaded, prompt, params)


def test_gpu_service_killed_during_assisted_decoding(loaded, model_folder):
    gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64")
    cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--assist", "always",
                       "--gpu-service", gpu.address, "--assist-timeout-s", "2")
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(cpu.address)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    prompts = {f"k{i}": [i + 3] * (i + 2) for i in range(4)}
    streams, outputs = {}, {}
    for request_id, prompt in prompts.items():
        tokens: list[int] = []
        responses = gpu_client.stream(request_id, prompt, params)
        read_until(responses, tokens, stop_after_tokens=1)
        gpu_client.migrate(request_id, cpu.address)
        read_until(responses, tokens)
        outputs[request_id] = tokens
        streams[request_id] = cpu_client.resume(request_id, len(tokens))
    # Read a few tokens per request so assisted iterations are under way, then kill the GPU engine.
    for request_id, responses in streams.items():
        read_until(responses, outputs[request_id], stop_after_tokens=len(outputs[request_id]) + 3)
    gpu.kill()
    finished = {}

    def drain(request_id):
        finished[request_id] = read_until(streams[request_id], outputs[request_id]).finish_reason

    threads = [threading.Thread(target=drain, args=(rid,)) for rid in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for request_id, prompt in prompts.items():
        assert finished[request_id] == FinishReason.LENGTH
        assert outputs[request_id] == solo(loaded, prompt, params), request_id
    assert cpu_client.wait_idle().kv_blocks_used == 0
    assert cpu.stop() == 0, cpu.log()
    assert "redoing it locally" in cpu.log()
