"""cpu_service with gpu_service as real processes: handoff after a GPU prefill, decode on the
CPU (Local and Assisted, the latter through shared memory and over the TCP data socket), migrations both ways,
and either daemon SIGKILLed under assisted load on both assist transports (shm, the TCP data
socket): no request lost, no
shared-memory segment left mapped or open in the survivor. Hand-offs and migrations run on both
KV data planes: shared memory (--kv-transport auto; both pools are in host memory here) and the TCP
data socket (--kv-transport tcp on both engines; with the Local CPU engine only, to bound the time)."""

from __future__ import annotations

import os
import threading

import pytest

from dualpace.sampling import FinishReason, SamplingParams
from tests.cpu_service.conftest import ENGINE_FLAGS, solo
from tests.helpers import wait_for
from toolkit.engine_client import EngineClient, read_until
from toolkit.processes import start_daemon

SEGMENT_NAME = "memfd:dualpace-assist"
ASSIST_TRANSPORTS = ("auto", "tcp")  # tcp: gpu_service's data socket, as across hosts
TCP_LOG = "dense assist through a TCP data socket"


def segments_held(pid: int) -> int:
    """How many mappings and descriptors of a Dense Assist segment process `pid` holds."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        mapped = sum(SEGMENT_NAME in line for line in maps)
    opened = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            opened += SEGMENT_NAME in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass  # closed meanwhile
    return mapped + opened


def start_pair(model_folder: str, transport: str):
    gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64")
    cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--assist", "always",
                       "--gpu-service", gpu.address, "--assist-timeout-s", "2", "--assist-transport", transport)
    return gpu, cpu


def start_assisted_requests(gpu_client, cpu_client, prompts, params):
    """Hand each prompt to the CPU engine after its first token; read until assisted steps run."""
    streams, outputs = {}, {}
    for request_id, prompt in prompts.items():
        tokens: list[int] = []
        responses = gpu_client.stream(request_id, prompt, params)
        read_until(responses, tokens, stop_after_tokens=1)
        gpu_client.migrate(request_id, cpu_client.address)
        read_until(responses, tokens)
        outputs[request_id] = tokens
        streams[request_id] = cpu_client.resume(request_id, len(tokens))
    for request_id, responses in streams.items():
        read_until(responses, outputs[request_id], stop_after_tokens=len(outputs[request_id]) + 3)
    return streams, outputs


TRANSPORT_USED = {"auto": "shm", "tcp": "tcp"}  # --kv-transport -> MigrateOutResponse.transport


@pytest.fixture(scope="module", params=sorted(TRANSPORT_USED))
def gpu(request, model_folder):
    # Slowed steps (a test-only fault) so a request is still decoding when it is moved.
    daemon = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                          "--kv-transport", request.param, env={"DUALPACE_FAULT_STEP_DELAY_MS": "3"})
    daemon.kv_transport = request.param
    yield daemon
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module", params=[("never", "auto"), ("always", "auto"), ("always", "tcp")],
                ids=["local", "assisted-shm", "assisted-tcp"])
def cpu(request, model_folder, gpu):
    assist, transport = request.param
    if gpu.kv_transport == "tcp" and assist != "never":
        pytest.skip("the TCP KV data plane runs with the Local CPU engine only (assist runs on the shm plane)")
    daemon = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "512",
                          "--assist", assist, "--gpu-service", gpu.address, "--assist-transport", transport,
                          "--kv-transport", gpu.kv_transport)
    yield f"{assist}-{transport}", daemon
    assert daemon.stop() == 0, daemon.log()
    # With a healthy gpu_service every assisted iteration must really have been assisted.
    assert "redoing it locally" not in daemon.log()
    if assist == "always":
        assert "iterations now run assisted" in daemon.log()
        assert ("dense assist through shared memory" in daemon.log()) == (transport == "auto")


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


@pytest.mark.parametrize("transport", ASSIST_TRANSPORTS)
def test_gpu_service_killed_during_assisted_decoding(loaded, model_folder, transport):
    gpu, cpu = start_pair(model_folder, transport)
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(cpu.address)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    prompts = {f"k{i}-{transport}": [i + 3] * (i + 2) for i in range(4)}
    streams, outputs = start_assisted_requests(gpu_client, cpu_client, prompts, params)
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
    assert wait_for(lambda: segments_held(cpu.process.pid), lambda n: n == 0, 30) == 0
    assert cpu.stop() == 0, cpu.log()
    assert "redoing it locally" in cpu.log()
    assert ("dense assist through shared memory" in cpu.log()) == (transport == "auto")
    assert (TCP_LOG in cpu.log()) == (transport == "tcp")


@pytest.mark.parametrize("transport", ASSIST_TRANSPORTS)
def test_cpu_service_killed_during_assisted_decoding(loaded, model_folder, transport):
    """The GPU engine loses its assist client mid-iteration: its session ends, the device is free
    (its own requests finish exactly), no segment stays mapped there, and a new CPU engine is assisted."""
    gpu, cpu = start_pair(model_folder, transport)
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(cpu.address)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    prompts = {f"c{i}-{transport}": [i + 5] * (i + 3) for i in range(3)}
    start_assisted_requests(gpu_client, cpu_client, prompts, params)
    if transport == "auto":
        assert segments_held(gpu.process.pid) >= 1  # the rings are in use right now
    cpu.kill()
    assert wait_for(lambda: segments_held(gpu.process.pid), lambda n: n == 0, 30) == 0
    own = [2, 7, 1, 8, 2, 8]
    own_params = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens: list[int] = []
    assert read_until(gpu_client.stream(f"own-{transport}", own, own_params), tokens).finish_reason == FinishReason.LENGTH
    assert tokens == solo(loaded, own, own_params)
    assert gpu_client.wait_idle().kv_blocks_used == 0  # the handed-off requests were freed there long ago
    again = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--assist", "always",
                         "--gpu-service", gpu.address, "--assist-transport", transport)
    try:
        again_client = EngineClient(again.address)
        prompt = [4, 4, 2]
        streams, outputs = start_assisted_requests(gpu_client, again_client, {"after": prompt},
                                                   SamplingParams(max_tokens=12, ignore_eos=True))
        read_until(streams["after"], outputs["after"])
        assert outputs["after"] == solo(loaded, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        assert again.stop() == 0, again.log()
    assert "redoing it locally" not in again.log()
    assert gpu.stop() == 0, gpu.log()
