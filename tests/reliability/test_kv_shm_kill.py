"""SIGKILL of either daemon in the middle of a KV transfer through shared memory.

The source holds its write lease for a while after the copy (DUALPACE_FAULT_KV_SHM_HOLD_MS),
so the kill lands after the target reserved its blocks and before anything was committed.

- Target killed: MigrateOut fails with UNAVAILABLE, the request carries on on the source and
  ends exactly as its solo run, the source frees its blocks and unmaps the dead pool.
- Source killed: the target frees the reserved blocks (once the dead sender's lease ended),
  holds no request and keeps serving.
Either way no shared-memory segment is left: nothing under /dev/shm, no socket of the dead
daemon, and no process maps its pool.
"""

from __future__ import annotations

import os
import threading

import grpc
import pytest

from dualpace.engine.transfer.same_host import boot_id
from dualpace.sampling import FinishReason
from dualpace.wire.v1 import engine_pb2
from tests.helpers import wait_for
from tests.reliability.conftest import (
    EngineProbe,
    EngineStream,
    assert_clean_exit,
    prompt_for,
    start_all,
    start_cpu,
    start_gpu,
)

pytestmark = pytest.mark.skipif(boot_id() is None or not os.path.isdir("/proc/self/map_files"),
                                reason="Linux shared memory")

HOLD_MS = 4000  # long enough to see the reservation and kill, whatever the machine's load
PROMPT = prompt_for(5, 40)
MAX_TOKENS = 120


def pools_mapped(pid: int) -> set[str]:
    """Inodes of the dualpace KV pools (memfds) process `pid` maps."""
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
        return {line.split()[4] for line in maps if "memfd:dualpace-kv" in line}


def sockets_of(pid: int) -> list[str]:
    with open("/proc/net/unix", encoding="ascii", errors="replace") as table:
        return [line for line in table if f"@dualpace-kv-{pid}-" in line]


def shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "dualpace" in name} if os.path.isdir("/dev/shm") else set()


@pytest.fixture
def pair(tiny_folder):
    daemons = start_all(
        source=lambda: start_gpu(tiny_folder, "--name", "shm-src", "--kv-transport", "auto", "--block-size", "8", step_delay_ms=5,
                                 env={"DUALPACE_FAULT_KV_SHM_HOLD_MS": str(HOLD_MS)}),
        target=lambda: start_cpu(tiny_folder, "--name", "shm-dst", "--kv-transport", "auto", "--block-size", "16", "--kv-blocks", "128"))
    probes = {name: EngineProbe(daemon.address) for name, daemon in daemons.items()}
    try:
        yield daemons, probes
    finally:
        for probe in probes.values():
            probe.close()
        assert_clean_exit(daemons.values())


def start_migration(daemons, probes, request_id: str):
    """A request decoding on the source, a MigrateOut of it on a thread, and the moment the target
    has reserved its blocks (the transfer under way)."""
    stream = EngineStream.run(probes["source"].stub, request_id, PROMPT, MAX_TOKENS)
    assert stream.wait_tokens(1), stream.error
    outcome: dict = {}

    def migrate() -> None:
        try:
            outcome["response"] = probes["source"].stub.MigrateOut(
                engine_pb2.MigrateOutRequest(request_id=request_id, target_address=daemons["target"].address),
                timeout=120)
        except grpc.RpcError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=migrate, daemon=True)
    thread.start()
    assert wait_for(probes["target"].blocks_used, lambda used: used > 0, 30.0) > 0, outcome
    return stream, thread, outcome


def test_target_killed_mid_transfer(pair, reference):
    daemons, probes = pair
    files_before = shm_files()
    source_pid, target_pid = daemons["source"].process.pid, daemons["target"].process.pid
    stream, thread, outcome = start_migration(daemons, probes, "kill-target")
    # its own pool and the target's (mapped right after the reservation)
    assert wait_for(lambda: len(pools_mapped(source_pid)), lambda n: n == 2, 10.0) == 2
    daemons["target"].kill()
    thread.join(60)
    assert "error" in outcome and outcome["error"].code() == grpc.StatusCode.UNAVAILABLE, outcome
    assert stream.wait(120) and stream.error is None, stream.error
    assert stream.finish_reason == FinishReason.LENGTH and not stream.migrated_to
    assert stream.tokens == reference(PROMPT, MAX_TOKENS) and not stream.problems
    assert probes["source"].wait_idle().kv_blocks_used == 0
    assert wait_for(lambda: len(pools_mapped(source_pid)), lambda n: n == 1, 10.0) == 1  # the dead pool unmapped
    assert sockets_of(target_pid) == [] and shm_files() == files_before


def test_source_killed_mid_transfer(pair):
    daemons, probes = pair
    files_before = shm_files()
    source_pid, target_pid = daemons["source"].process.pid, daemons["target"].process.pid
    stream, thread, _ = start_migration(daemons, probes, "kill-source")
    daemons["source"].kill()
    thread.join(60)
    assert stream.wait(60) and stream.error is not None  # its engine is gone (the router resubmits)
    load = probes["target"].wait_idle()
    assert load.kv_blocks_used == 0 and "kill-source" not in probes["target"].requests()
    assert len(pools_mapped(target_pid)) == 1  # only its own
    assert sockets_of(source_pid) == [] and shm_files() == files_before
    probes["target"].assert_serving_and_generates("after-kill")
