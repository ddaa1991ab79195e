"""Prefix caching across gpu_service and cpu_service as real processes (fp32): a hand-off's
imported blocks become cpu_service's cache, so a request prefilled on the CPU engine hits them;
the GPU engine keeps the blocks it freed after the hand-off; outputs equal a full recompute;
blocks in use return to 0 with cached blocks reported apart; --prefix-caching off reuses nothing."""

from __future__ import annotations

import pytest

from toolkit.engine_client import EngineClient, read_until
from dualpace.sampling import FinishReason, SamplingParams
from tests.cpu_service.conftest import ENGINE_FLAGS, solo
from toolkit.processes import start_daemon

SYSTEM = [7, 3, 11, 5, 2, 19, 23, 4, 9, 31, 8, 6, 14, 27, 1, 12, 40, 41, 13, 17, 29, 33, 3, 5]  # 3 blocks


def generate(client: EngineClient, request_id: str, prompt, params) -> tuple[list[int], int]:
    tokens: list[int] = []
    last = read_until(client.stream(request_id, prompt, params), tokens)
    assert last.finish_reason == FinishReason.LENGTH
    return tokens, last.num_cached_tokens


@pytest.mark.parametrize("assist", ["never", "always"])
def test_hits_on_both_engines_after_a_handoff_are_exact(loaded, model_folder, assist):
    gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64")
    cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                       "--assist", assist, "--gpu-service", gpu.address)
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(cpu.address)
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        first = SYSTEM + [50, 51, 52]
        tokens: list[int] = []
        responses = gpu_client.stream("first", first, params)
        assert read_until(responses, tokens, stop_after_tokens=2) is None
        gpu_client.migrate("first", cpu_client.address)
        read_until(responses, tokens)
        last = read_until(cpu_client.resume("first", len(tokens)), tokens)
        assert last.num_cached_tokens == 0
        assert tokens == solo(loaded, first, params)

        on_cpu = SYSTEM + [60, 61]  # prefilled by cpu_service itself, on the imported blocks
        assert generate(cpu_client, "cpu-hit", on_cpu, params) == (solo(loaded, on_cpu, params), 24)
        on_gpu = SYSTEM + [70]  # the GPU engine kept the blocks it freed after the hand-off
        assert generate(gpu_client, "gpu-hit", on_gpu, params) == (solo(loaded, on_gpu, params), 24)
        for client in (gpu_client, cpu_client):
            load = client.wait_idle()
            assert load.kv_blocks_used == 0 and load.kv_blocks_cached >= 3
    finally:
        for daemon in (cpu, gpu):
            assert daemon.stop() == 0, daemon.log()


def test_prefix_caching_off_reuses_nothing(loaded, model_folder):
    gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                       "--prefix-caching", "off")
    client = EngineClient(gpu.address)
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        expected = solo(loaded, SYSTEM + [1], params)
        for request_id in ("a", "b"):
            assert generate(client, request_id, SYSTEM + [1], params) == (expected, 0)
        load = client.wait_idle()
        assert (load.kv_blocks_used, load.kv_blocks_cached) == (0, 0)
    finally:
        assert gpu.stop() == 0, gpu.log()
