"""The host tier across the three daemons as real processes (fp32, the tiny model): gpu_service
offers a finished conversation turn's cached blocks to cpu_service (--host-tier); another
request then evicts them from the GPU engine's small pool; the router, whose prefix index now
finds the history only on the CPU engine, continues the conversation there; cpu_service
prefills only the new tokens (cached_tokens in the usage), and the reply is the one a full
recompute gives; or, for a new message too long to prefill on the CPU engine, the router has
cpu_service copy the history back into gpu_service's cache and the GPU engine prefills only the
new tokens, with the same reply. Blocks in use return to 0 on both engines."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from dualpace.sampling import SamplingParams
from dualpace.wire.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.cpu_service.conftest import ENGINE_FLAGS, solo
from tests.reliability.test_nan_logits import scrape
from toolkit.engine_client import EngineClient, read_until
from toolkit.processes import start_all, start_daemon

HANG_GUARD_S = 120.0  # only against a hang: every wait below ends on a condition, not a duration
HISTORY = [(i * 37 + 11) % 400 + 1 for i in range(30)]


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def generate_through_router(stub, prompt: list[int], max_tokens: int):
    message = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(token_ids=prompt),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens, engines, usage = [], set(), None
    for response in stub.Generate(message, timeout=HANG_GUARD_S):
        tokens.extend(response.token_ids)
        if response.token_ids:
            engines.add(response.engine)
        if response.HasField("usage"):
            usage = response.usage
    return tokens, engines, usage


def index_in_sync(stub, gpu: EngineClient, cpu: EngineClient) -> bool:
    """The router's prefix index holds what each (idle) engine caches, no more, no less, and its
    load views show the engines idle (the placement rules read those)."""
    engines = stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10).engines
    placed = {e.name: e.prefix_index_blocks for e in engines}
    idle = all(e.kv_blocks_used == 0 and e.num_running == 0 for e in engines)
    return idle and placed.get("gpu") == gpu.load().kv_blocks_cached and placed.get("cpu") == cpu.load().kv_blocks_cached


@pytest.mark.parametrize("path", ["continue-on-cpu", "copy-to-gpu"])
def test_a_conversation_resumes_from_the_host_tier(loaded, model_folder, path):
    """continue-on-cpu: the CPU engine decodes from its cached history; copy-to-gpu: the new
    message is longer than --host-tier-max-suffix-tokens, so the router has the CPU engine copy
    the history back into the GPU engine's cache (CopyPrefix) and the GPU engine runs it."""
    max_suffix = "64" if path == "continue-on-cpu" else "4"
    sockets = Path(tempfile.mkdtemp(prefix="dualpace-host-tier-"))
    gpu_address, cpu_address = f"unix:{sockets / 'gpu.sock'}", f"unix:{sockets / 'cpu.sock'}"
    engines = start_all(  # both addresses are known before either starts
        gpu=lambda: start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "12",
                                 "--name", "gpu", "--host-tier", cpu_address, "--metrics-port", "0",
                                 listen=gpu_address),
        cpu=lambda: start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "64",
                                 "--name", "cpu", "--assist", "never", "--gpu-service", gpu_address,
                                 "--peer", gpu_address, listen=cpu_address))
    gpu, cpu = engines["gpu"], engines["cpu"]
    router = start_daemon("router", "serve", "--gpu", gpu_address, "--cpu", cpu_address, "--model", model_folder,
                          "--no-migrate", "--host-tier-min-gain-tokens", "8",
                          "--host-tier-max-suffix-tokens", max_suffix)
    gpu_client, cpu_client = EngineClient(gpu_address), EngineClient(cpu_address)
    channel = grpc.insecure_channel(router.address)
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        # Turn 1 on the GPU engine (idle, with room); its 4 full blocks (32 of 39 computed tokens)
        # are offered to cpu_service's pool when it finishes.
        reply, engines, _ = generate_through_router(stub, HISTORY, 10)
        assert engines == {"gpu"} and reply == solo(loaded, HISTORY, SamplingParams(max_tokens=10, ignore_eos=True))
        wait_for(lambda: cpu_client.load().kv_blocks_cached >= 4, "the host tier to hold turn 1")
        assert cpu_client.load().kv_blocks_used == 0
        offered = scrape(gpu)
        assert offered[("dualpace_host_tier_offers", (("engine", "gpu"), ("outcome", "accepted")))] == 1
        assert offered[("dualpace_host_tier_offered_blocks", (("engine", "gpu"),))] == 4
        assert offered[("dualpace_host_tier_offers", (("engine", "gpu"), ("outcome", "failed")))] == 0

        # A long request takes the GPU engine's whole pool (12 blocks): turn 1 is evicted there.
        filler_params = SamplingParams(max_tokens=2, ignore_eos=True)
        read_until(gpu_client.stream("filler", [(i * 5) % 300 + 3 for i in range(90)], filler_params), [])
        wait_for(lambda: index_in_sync(stub, gpu_client, cpu_client), "the router's index to catch up")

        turn2 = HISTORY + reply + [77, 78, 79, 80, 81, 82]  # 46 tokens
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        tokens, engines, usage = generate_through_router(stub, turn2, 8)
        # continued where the history lives, or copied back to the GPU engine; either way only
        # 14 tokens were prefilled
        assert engines == ({"cpu"} if path == "continue-on-cpu" else {"gpu"})
        assert usage.cached_tokens == 32
        assert tokens == solo(loaded, turn2, params)
        if path == "copy-to-gpu":  # the copy went through the GPU engine's import, cache only
            assert gpu_client.load().kv_blocks_cached >= 4
            with grpc.insecure_channel(cpu_address) as cpu_channel:
                copy_prefix = engine_pb2_grpc.EngineStub(cpu_channel).CopyPrefix
                # Turn 2, finished on the GPU engine, is offered to the host tier too (6 full blocks),
                # after the filler (offers go in order of finishing).
                wait_for(lambda: scrape(gpu)[("dualpace_host_tier_offers", (("engine", "gpu"),
                                                                            ("outcome", "accepted")))] == 3,
                         "the host tier to take turn 2")
                # Copied again: the GPU engine holds every block now, so none is sent (skip_cached).
                again = copy_prefix(engine_pb2.CopyPrefixRequest(token_ids=turn2, target_address=gpu_address),
                                    timeout=HANG_GUARD_S)
                assert (again.num_tokens, again.num_sent_tokens, again.target_engine) == (40, 0, "gpu")
                with pytest.raises(grpc.RpcError) as refused:  # only to a --peer
                    copy_prefix(engine_pb2.CopyPrefixRequest(token_ids=turn2, target_address="127.0.0.1:9"),
                                timeout=HANG_GUARD_S)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        for client in (gpu_client, cpu_client):
            assert client.wait_idle().kv_blocks_used == 0
    finally:
        channel.close()
        codes = [(daemon.stop(), daemon) for daemon in (router, cpu, gpu)]
        shutil.rmtree(sockets, ignore_errors=True)  # the sockets' folder (it was left in /tmp after every run)
        for code, daemon in codes:
            assert code == 0, daemon.log()
