"""Cooperative execution end to end:
gpu_service and cpu_service as real processes on loopback, Dense Assist over the shared-memory
ring, both writing step timelines. Requests prefilled on the GPU engine and handed to the CPU engine
decode there while the GPU engine serves a request of its own; then:

- every greedy output equals the offline generator's (a full recompute, equal to Hugging Face fp32);
- `gated` (NEO as built): every CPU decode iteration ran cooperatively, and the GPU step it names
  lists this iteration among its joins (identity, not timing: bench/cooperative_timeline);
- `dualpace` (--assist always): iterations join or run staged, as the GPU's step allows; each
  one that says it joined is found among its GPU step's joins;
- no iteration was redone locally (zero fallbacks without faults).

The GPU-wait share is a measurement, printed here and never asserted (bench/cooperative_timeline.py).
Every wait is bounded: gRPC streams by their deadline, reader threads by a join timeout."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from bench.cooperative_timeline import TimelineCheck, check_timelines, format_report, timeline_paths
from dualpace.engine.step_timeline import read_timeline
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.v1 import assist_pb2
from tests.cpu_service.conftest import ENGINE_FLAGS, solo
from toolkit.engine_client import EngineClient, read_until
from toolkit.processes import start_daemon

JOINS_BUILT = "join_engine_iteration" in assist_pb2.AssistBegin.DESCRIPTOR.fields_by_name
pytestmark = pytest.mark.skipif(not JOINS_BUILT, reason="cooperative execution is not built in this tree: "
                                "AssistBegin has no join_engine_iteration field")

STREAM_TIMEOUT_S = 120.0  # per gRPC stream
READER_JOIN_S = 150.0  # per reader thread, after the streams' own deadline
NUM_CPU_REQUESTS = 3
CPU_PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
OWN_PARAMS = SamplingParams(max_tokens=60, ignore_eos=True)


def read_in_thread(responses, tokens: list[int], finished: dict, key: str) -> threading.Thread:
    def read() -> None:
        finished[key] = read_until(responses, tokens).finish_reason

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@dataclass
class HandoffRun:
    check: TimelineCheck
    cpu_log: str
    num_cpu_tokens: list[int]  # per handed-off request: the tokens left for the CPU engine


def run_handoffs(loaded, model_folder: str, directory: str, policy: str) -> HandoffRun:
    """The GPU engine's own request plus NUM_CPU_REQUESTS hand-offs to the CPU engine, to the end;
    asserts the outputs and clean stops, returns the timelines' check."""
    paths = timeline_paths(directory, policy, clear=True)
    gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                       step_timeline=paths["gpu"])
    cpu = None
    num_cpu_tokens: list[int] = []
    try:
        cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "256",
                           "--policy", policy, "--assist", "always", "--gpu-service", gpu.address,
                           "--assist-transport", "auto", "--assist-timeout-s", "30", step_timeline=paths["cpu"])
        gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(cpu.address)
        outputs: dict[str, list[int]] = {}
        finished: dict[str, FinishReason | None] = {}
        own_prompt = [2, 7, 1, 8, 2, 8, 1, 8]
        outputs["own"] = []
        readers = [read_in_thread(gpu_client.stream("own", own_prompt, OWN_PARAMS, STREAM_TIMEOUT_S),
                                  outputs["own"], finished, "own")]
        prompts = {f"cpu-{i}": [i + 3, 11, 5 + i] * (i + 2) for i in range(NUM_CPU_REQUESTS)}
        for request_id, prompt in prompts.items():  # prefill on the GPU engine, decode on the CPU engine
            tokens = outputs[request_id] = []
            responses = gpu_client.stream(request_id, prompt, CPU_PARAMS, STREAM_TIMEOUT_S)
            assert read_until(responses, tokens, stop_after_tokens=1) is None
            assert gpu_client.migrate(request_id, cpu_client.address).target_engine == "cpu"
            assert read_until(responses, tokens).migrated_to == cpu_client.address
            num_cpu_tokens.append(CPU_PARAMS.max_tokens - len(tokens))
            readers.append(read_in_thread(cpu_client.resume(request_id, len(tokens), STREAM_TIMEOUT_S),
                                          tokens, finished, request_id))
        for reader in readers:
            reader.join(READER_JOIN_S)
        assert not any(reader.is_alive() for reader in readers), f"streams still open: {finished}"
        assert finished == {key: FinishReason.LENGTH for key in outputs}
        assert outputs["own"] == solo(loaded, own_prompt, OWN_PARAMS)
        for request_id, prompt in prompts.items():
            assert outputs[request_id] == solo(loaded, prompt, CPU_PARAMS), request_id
        assert cpu_client.wait_idle().kv_blocks_used == 0 and gpu_client.wait_idle().kv_blocks_used == 0
    finally:
        cpu_status = None if cpu is None else cpu.stop()  # the engines write their last records on the way out
        gpu_status = gpu.stop()
    assert cpu_status == 0, cpu.log()
    assert gpu_status == 0, gpu.log()
    assert "redoing it locally" not in cpu.log(), cpu.log()  # zero fallbacks without faults
    assert "dense assist through shared memory" in cpu.log()
    check = check_timelines(read_timeline(paths["gpu"]), read_timeline(paths["cpu"]), policy)
    print(format_report(check))  # the GPU-wait share: a measurement, not asserted
    return HandoffRun(check, cpu.log(), num_cpu_tokens)


def test_gated_cpu_decodes_advance_only_inside_gpu_steps(loaded, model_folder, tmp_path):
    run = run_handoffs(loaded, model_folder, str(tmp_path), "gated")
    report = format_report(run.check)
    assert run.check.advance_only_inside_gpu, report
    assert set(run.check.cpu_modes) == {"cooperative"}, report
    # Each CPU decode iteration makes one token per request on board; the first step after an
    # import may count as a prefill of the handed-off token, hence the one spare.
    assert run.check.num_cpu_matched >= max(run.num_cpu_tokens) - 1, report


def test_dualpace_joins_are_found_among_gpu_steps(loaded, model_folder, tmp_path):
    run = run_handoffs(loaded, model_folder, str(tmp_path), "dualpace")
    report = format_report(run.check)
    assert not run.check.failures, report  # each iteration that joined names a GPU step that lists it
    assert run.check.num_cpu_matched == run.check.cpu_modes["cooperative"], report
    assert set(run.check.cpu_modes) <= {"cooperative", "assisted"}, report  # joined or staged, never local
    assert sum(run.check.cpu_modes.values()) >= max(run.num_cpu_tokens) - 1, report
