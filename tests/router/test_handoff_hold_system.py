"""The hand-off hold across real daemons: router, gpu_service and cpu_service as
subprocesses on 127.0.0.1. Under dualpace the router asks the GPU engine to hold a request it
will hand to the CPU engine (NewEngineRequest.hold_after_first_token), and the move takes it from
the hold; under gated it does not ask, and the move pauses the request at a step boundary. Either
way every output equals its solo greedy run.

The observable is the GPU engine's migrate-out debug line, which says "(held after its first
token)" exactly when the move took the request from the hold (dualpace.engine.transfer.migration._move).
No timing is asserted; every wait is a hang guard.
"""

from __future__ import annotations

import json

import pytest

from dualpace.model.loader import load_model
from dualpace.sampling import SamplingParams
from dualpace.wire.v1 import router_pb2
from tests.helpers import reference_tokens
from tests.router.test_router_system import ENGINE_FLAGS, Streams
from toolkit.processes import start_daemon

# 8 blocks of 8 tokens: one request of PROMPT_TOKENS + MAX_TOKENS (reserved at its final size) fits
# the GPU engine at a time, so the others go to the CPU engine, each prefilled on the GPU and handed off.
GPU_KV_BLOCKS = 8
MAX_TOKENS = 40
NUM_REQUESTS = 4
HELD = "(held after its first token)"


def hold_prompts() -> dict[str, list[int]]:
    return {f"h{i}": [(i * 17 + j * 5) % 400 + 1 for j in range(6)] for i in range(NUM_REQUESTS)}


def start_policy_system(model_folder: str, policy: str):
    """gpu_service (DEBUG: its migrate-out lines), cpu_service and the router, all under `policy`;
    load-driven migrations off, so every move is a hand-off after a GPU prefill."""
    gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", str(GPU_KV_BLOCKS),
                       "--log-level", "DEBUG")
    daemons = [gpu]
    try:
        gated = policy == "gated"  # the CPU engine's decodes then ride in the GPU engine's steps (Dense Assist)
        cpu_policy = ("--policy", "gated", "--gpu-service", gpu.address) if gated else ("--assist", "never")
        cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "512", *cpu_policy)
        daemons.append(cpu)
        daemons.append(start_daemon("router", "serve", "--gpu", gpu.address, "--cpu", cpu.address,
                                    "--model", model_folder, "--policy", policy, "--no-migrate"))
    except BaseException:
        for daemon in reversed(daemons):
            daemon.stop()
        raise
    return daemons


def migrate_out_lines(log: str) -> dict[str, str]:
    """request id -> the GPU engine's migrate-out debug line for it (JSON lines; others skipped)."""
    lines = {}
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        event = str(record.get("event", ""))
        if event.startswith("migrate out phases: request "):
            lines[event.removeprefix("migrate out phases: request ").split(" ", 1)[0].rstrip(",")] = event
    return lines


@pytest.mark.parametrize("policy", ["dualpace", "gated"])
def test_handoff_taken_from_the_hold_only_under_dualpace(model_folder, policy):
    gpu, cpu, router = start_policy_system(model_folder, policy)
    try:
        streams = Streams(router.address)
        requests = hold_prompts()
        for request_id, prompt in requests.items():
            streams.start(request_id, prompt, MAX_TOKENS)
        streams.join()
        assert not any(thread.is_alive() for thread in streams.threads), router.log()[-4000:]
        assert not streams.errors, {k: (e.code(), e.details()) for k, e in streams.errors.items()}
        migrations = streams.placements().migrations
        streams.channel.close()
    finally:
        codes = [daemon.stop() for daemon in (router, cpu, gpu)]
    assert codes == [0, 0, 0], (codes, router.log()[-4000:], gpu.log()[-4000:])

    loaded = load_model(model_folder, dtype="fp32")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for request_id, prompt in requests.items():
        assert streams.tokens[request_id] == reference_tokens(loaded, prompt, params), request_id

    handed_off = {m.request_id for m in migrations if m.outcome == router_pb2.MIGRATION_OUTCOME_COMMITTED
                  and (m.from_engine, m.to_engine) == ("gpu", "cpu")}
    assert handed_off, ("no request was handed off to the CPU engine", router.log()[-4000:])
    assert all(len(streams.engines[rid]) == 2 for rid in handed_off), streams.engines  # gpu's first token, then cpu
    lines = migrate_out_lines(gpu.log())
    assert handed_off <= set(lines), (handed_off, lines, gpu.log()[-4000:])
    held = {rid for rid in handed_off if HELD in lines[rid]}
    # A hold no move took within its timeout (HandoffHolds.timeout_s, a stalled router) says so in the log.
    expired = [line for line in gpu.log().splitlines() if "for a hand-off that did not come" in line]
    assert held == (handed_off if policy == "dualpace" else set()), (lines, expired)
