"""Several same-host KV transfers into one pool at once, through real daemons (shared memory).

Found when the data-plane branches were merged: 4-9 hand-offs that mapped the target's pool
at the same moment killed the sending engine without a Python traceback. Each waiting sender
mapped the pool itself and the last one replaced the others' entry, whose watch socket was
then closed by garbage collection while the event loop (uvloop, i.e. libuv) still polled its
descriptor, and libuv aborts the process on such a descriptor. Now a pool is mapped once per
process however many transfers wait for it.

Here a source engine starts NUM_REQUESTS requests, then moves them all to a fresh target at
once (the first transfers to a pool are the ones that map it), then all back at once (the
other direction maps the other pool). Every move must go through shared memory, both engines
must survive, each pool is mapped once by the other engine, and every request ends exactly
as its solo greedy run (up to a near-tie of the two most likely tokens, where fp32 rounding
may pick either: `near_tie_position`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from dualpace.engine.transfer.same_host import boot_id
from dualpace.sampling import FinishReason, SamplingParams
from tests.reliability.conftest import prompt_for, start_all, start_cpu, start_gpu
from tests.reliability.test_kv_shm_kill import pools_mapped
from toolkit.engine_client import EngineClient, read_until

pytestmark = pytest.mark.skipif(boot_id() is None or not os.path.isdir("/proc/self/map_files"),
                                reason="Linux shared memory")

NUM_REQUESTS = 8
MAX_TOKENS = 200  # still running after two moves on a loaded machine (steps are slowed below)
PROMPTS = {f"conc-{i}": prompt_for(i, 24) for i in range(NUM_REQUESTS)}


def move_all(source: EngineClient, target: EngineClient, responses: dict, tokens: dict, source_log) -> None:
    """MigrateOut of every request at once; then follow each on the target."""
    with ThreadPoolExecutor(NUM_REQUESTS) as threads:
        futures = {rid: threads.submit(source.migrate, rid, target.address) for rid in responses}
    errors = {rid: future.exception() for rid, future in futures.items() if future.exception() is not None}
    assert not errors, (errors, source_log()[-6000:])  # the source's log shows a crash's native stack
    replies = {rid: future.result() for rid, future in futures.items()}
    not_shm = {rid: reply.transport for rid, reply in replies.items() if reply.transport != "shm"}
    assert not not_shm, (not_shm, source_log()[-6000:])
    for request_id, stream in responses.items():
        assert read_until(stream, tokens[request_id]).migrated_to == target.address
        responses[request_id] = target.resume(request_id, len(tokens[request_id]))
        assert read_until(responses[request_id], tokens[request_id], stop_after_tokens=len(tokens[request_id]) + 1) \
            is None


def test_concurrent_shm_transfers_both_ways(tiny_folder, reference, near_tie_position):
    daemons = start_all(
        gpu=lambda: start_gpu(tiny_folder, "--name", "conc-gpu", "--kv-transport", "auto", "--block-size", "8",
                              "--kv-blocks", "256", step_delay_ms=20),
        cpu=lambda: start_cpu(tiny_folder, "--name", "conc-cpu", "--kv-transport", "auto", "--block-size", "16",
                              "--kv-blocks", "256", step_delay_ms=20))
    gpu, cpu = EngineClient(daemons["gpu"].address), EngineClient(daemons["cpu"].address)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        responses = {rid: gpu.stream(rid, prompt, params) for rid, prompt in PROMPTS.items()}
        tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
        for request_id, stream in responses.items():
            assert read_until(stream, tokens[request_id], stop_after_tokens=2) is None
        move_all(gpu, cpu, responses, tokens, daemons["gpu"].log)
        move_all(cpu, gpu, responses, tokens, daemons["cpu"].log)
        for request_id, stream in responses.items():
            assert read_until(stream, tokens[request_id]).finish_reason == FinishReason.LENGTH
            expected = reference(PROMPTS[request_id], MAX_TOKENS)
            tie = near_tie_position(tiny_folder, PROMPTS[request_id], expected)
            assert len(tokens[request_id]) == MAX_TOKENS, request_id
            assert tokens[request_id][:tie] == expected[:tie], (request_id, tie)
        for name, daemon in daemons.items():
            assert daemon.process.poll() is None, (name, daemon.log()[-4000:])
            assert daemon.log().count("mapped the KV pool") == 1, (name, daemon.log()[-4000:])
            assert len(pools_mapped(daemon.process.pid)) == 2  # its own and the other's, once
        assert gpu.wait_idle().kv_blocks_used == 0 and cpu.wait_idle().kv_blocks_used == 0
    finally:
        gpu.close()
        cpu.close()
        for daemon in daemons.values():
            daemon.stop()
