"""A router SIGKILLed with requests in flight and not restarted.

The router starts engine requests with keep_running_on_disconnect, so they outlive it; with
nobody re-attaching, each engine's orphan lease (`--orphan-timeout-s`, small here) expires and
the engine aborts them. Criteria: both engines reach 0 requests and 0 used KV blocks
(ListRequests and GetLoad), every request is counted in dualpace_orphaned_requests_total and
logged, and the engines serve a new request afterwards. The requests are far from done when the
router dies (every step is slowed by a test-only fault), so they end by the lease, not by
finishing; the waits are hang guards only.
"""

from __future__ import annotations

import re
import urllib.request

import grpc

from dualpace.wire.v1 import router_pb2
from tests.reliability.conftest import (
    RouterStream,
    prompt_for,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec
from tests.helpers import wait_for

HANG_GUARD_S = 120.0
STEP_DELAY_MS = 30
NUM_REQUESTS = 6
MAX_TOKENS = 480  # the tiny model's context is 512: about 15 s of steps, far beyond the lease
LEASE = ("--orphan-timeout-s", "1", "--metrics-port", "0")
METRICS = re.compile(r"metrics on (\S+)")
ORPHANED = re.compile(r"^dualpace_orphaned_requests_total\{engine=\"[^\"]+\"\} (\S+)$", re.M)


def orphaned_total(daemon) -> float:
    address = METRICS.search(daemon.log()).group(1)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return float(ORPHANED.search(response.read().decode()).group(1))


SYSTEM = SystemSpec(engines=(
    EngineSpec("gpu", "gpu", ("--name", "gpu-orphan", "--block-size", "8", *LEASE, "--kv-blocks", "256"),
               step_delay_ms=STEP_DELAY_MS),
    EngineSpec("cpu", "cpu", ("--name", "cpu-orphan", "--block-size", "8", *LEASE, "--kv-blocks", "1024"),
               step_delay_ms=STEP_DELAY_MS),
))


def test_orphans_of_a_dead_router_are_aborted_within_the_lease(system):
    engines, router, stub = system.engines, system.router, system.stub
    streams = [RouterStream.run(stub, f"orphan-{i}", prompt_for(i), MAX_TOKENS, timeout_s=HANG_GUARD_S)
               for i in range(NUM_REQUESTS)]
    for stream in streams:
        assert stream.wait_tokens(3, HANG_GUARD_S), (stream.request_id, stream.error)
    placed = stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10).requests
    assert {r.request_id for r in placed} == {s.request_id for s in streams}
    assert not any(s.done.is_set() for s in streams), "a request ended before the router died"
    router.kill()
    for stream in streams:
        assert stream.wait(HANG_GUARD_S) and stream.code == grpc.StatusCode.UNAVAILABLE, stream.error

    probes = system.probes
    for name, probe in probes.items():
        load = probe.wait_idle(HANG_GUARD_S)
        assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0), (name, load)
        assert probe.requests() == {}, name
    counted = {name: orphaned_total(daemon) for name, daemon in engines.items()}
    logged = {name: daemon.log().count("orphaned request aborted") for name, daemon in engines.items()}
    assert sum(counted.values()) == NUM_REQUESTS, counted
    assert logged == {name: int(count) for name, count in counted.items()}
    for name, probe in probes.items():
        probe.assert_serving_and_generates(f"after-orphans-{name}")
        assert wait_for(probe.blocks_used, lambda used: used == 0, HANG_GUARD_S) == 0
