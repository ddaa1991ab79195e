"""An engine dies holding requests no surviving engine can ever hold.

The router keeps such a request paused and continues it on the same engine once that engine
is back on its address (restarted by `dualpace up`, as systemd's Restart=on-failure would),
with the tokens so far and the same seed, so the output is the solo greedy run's. Under
`dualpace up` on the tiny model (steps slowed by a test-only fault so requests are mid-stream):
cpu_service SIGKILLed while it holds requests gpu_service's 6-block pool cannot fit, and the
mirror case, gpu_service SIGKILLed holding requests cpu_service's 6-block pool cannot fit.
Criteria: every request completes greedy-identical to its solo run, and neither engine keeps a
KV block or a request. An engine that never returns: its requests show as waiting for it in
`dualpace-router placement`, a client may cancel one meanwhile, and the others end UNAVAILABLE
naming the engine after --resume-wait-s; the survivor holds nothing. Waits are hang guards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import pytest

from dualpace.wire.router_messages import placements_to_dict
from dualpace.wire.v1 import router_pb2
from tests.helpers import wait_for
from tests.reliability.conftest import (
    EngineProbe,
    RouterStream,
    assert_exact,
    cancelled_if_unfinished,
    prompt_for,
    router_stub,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec
from tests.reliability.test_up_supervision import HANG_GUARD_S, running_up

NUM_REQUESTS = 4
MAX_TOKENS = 120  # prompt + 120 tokens needs 8 blocks of 16: more than the small pool's 6
SMALL_POOL_BLOCKS = "6"
TOKENS_BEFORE_KILL = 3
KIND = {"cpu_service": "cpu", "gpu_service": "gpu"}


@pytest.fixture(params=["cpu_service", "gpu_service"])
def up_with_a_small_pool(request, tiny_folder):
    """(victim, `dualpace up`): the engine that is not the victim has a 6-block pool."""
    victim = request.param
    pools = {"cpu_service": ("--gpu-kv-blocks", SMALL_POOL_BLOCKS, "--cpu-kv-blocks", "1024"),
             "gpu_service": ("--gpu-kv-blocks", "1024", "--cpu-kv-blocks", SMALL_POOL_BLOCKS)}[victim]
    with running_up(tiny_folder, *pools, "--max-restarts", "1") as running:
        yield victim, running


def placements(stub) -> dict:
    return placements_to_dict(stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10))


def test_requests_wait_for_their_engine_and_complete_exactly(up_with_a_small_pool, reference):
    victim, up = up_with_a_small_pool
    channel = grpc.insecure_channel(up.router)
    stub = router_stub(channel)
    old_pid = up.pids[victim]
    prompts = {f"back-{victim}-{i}": prompt_for(i, 3 + i) for i in range(NUM_REQUESTS)}
    streams = {rid: RouterStream.run(stub, rid, prompt, MAX_TOKENS, timeout_s=HANG_GUARD_S)
               for rid, prompt in prompts.items()}
    with cancelled_if_unfinished(streams.values()):
        for rid, stream in streams.items():
            assert stream.wait_tokens(TOKENS_BEFORE_KILL, HANG_GUARD_S), (rid, stream.error, up.log())
        on_victim = {r["request_id"] for r in placements(stub)["requests"] if r["engine"] == KIND[victim]}
        assert on_victim == set(prompts), "every request must be on the engine with the large pool"
        assert not any(s.done.is_set() for s in streams.values()), "a request ended before the kill"
        os.kill(old_pid, signal.SIGKILL)
        for rid, stream in streams.items():
            assert stream.wait(HANG_GUARD_S), rid
    assert_exact(streams, prompts, MAX_TOKENS, reference, up.log())
    assert up.wait_until(lambda: up.pids[victim] != old_pid), f"{victim} was not restarted:\n{up.log()}"
    for name in ("gpu_service", "cpu_service"):
        probe = EngineProbe(up.addresses[name])
        load = probe.wait_idle(HANG_GUARD_S)
        assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0), name
        probe.close()
    channel.close()


RESUME_WAIT_S = 3.0


# gpu_service with a 6-block pool, cpu_service with a large one, behind a router that waits
# RESUME_WAIT_S for an engine to come back.
NEVER_RETURNS = SystemSpec(
    engines=(EngineSpec("gpu", "gpu", ("--name", "gpu-small", "--block-size", "16", "--kv-blocks", SMALL_POOL_BLOCKS),
                        step_delay_ms=10),
             EngineSpec("cpu", "cpu", ("--name", "cpu-gone", "--block-size", "16", "--kv-blocks", "1024"),
                        step_delay_ms=10)),
    router_flags=("--no-migrate", "--resume-wait-s", str(RESUME_WAIT_S)))


@pytest.mark.parametrize("fresh_system", [NEVER_RETURNS], indirect=True)
def test_an_engine_that_never_returns_ends_them_unavailable(fresh_system):
    engines, stub, router_address = fresh_system.engines, fresh_system.stub, fresh_system.router.address
    prompts = {f"gone-{i}": prompt_for(i, 4) for i in range(3)}
    streams = {rid: RouterStream.run(stub, rid, prompt, MAX_TOKENS) for rid, prompt in prompts.items()}
    with cancelled_if_unfinished(streams.values()):
        for rid, stream in streams.items():
            assert stream.wait_tokens(TOKENS_BEFORE_KILL), (rid, stream.error)
        engines["cpu"].kill()
        waiting = wait_for(lambda: {r["request_id"]: r for r in placements(stub)["requests"]},
                           lambda shown: len(shown) == len(prompts)
                           and all(r["state"] == "waiting_for_engine" for r in shown.values()), HANG_GUARD_S)
        assert {rid: (r["engine"], r["state"]) for rid, r in waiting.items()} == {
            rid: ("cpu-gone", "waiting_for_engine") for rid in prompts}, waiting
        # What an operator sees: `dualpace-router placement`.
        cli = subprocess.run([sys.executable, "-m", "router", "placement", "--router", router_address, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        shown = {r["request_id"]: r for r in json.loads(cli.stdout)["requests"]}
        assert all(shown[rid]["state"] == "waiting_for_engine" for rid in prompts), shown
        streams["gone-0"].cancel()  # the client may give up while it waits
        for stream in streams.values():
            assert stream.wait(HANG_GUARD_S), stream.request_id
    assert streams["gone-0"].code == grpc.StatusCode.CANCELLED, streams["gone-0"].error
    for rid in ("gone-1", "gone-2"):
        stream = streams[rid]
        assert stream.code == grpc.StatusCode.UNAVAILABLE, (rid, stream.error)
        assert "waited for engine cpu-gone" in stream.error.details(), stream.error.details()
        assert stream.error.details().endswith("within 3 s (--resume-wait-s)"), stream.error.details()
        assert TOKENS_BEFORE_KILL <= len(stream.tokens) < MAX_TOKENS, rid
    assert wait_for(lambda: placements(stub)["requests"], lambda shown: not shown, HANG_GUARD_S) == []
    load = fresh_system.probes["gpu"].wait_idle()
    assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
