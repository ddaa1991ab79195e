"""The three daemons as real processes: placement across engines, migrations, engine
failures and a router restart, with every output equal to its solo greedy run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dualpace.model.loader import load_model
from dualpace.sampling import SamplingParams
from dualpace.wire.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.helpers import reference_tokens
from toolkit.processes import start_daemon

ENGINE_FLAGS = ("--dtype", "fp32", "--threads", "1", "--block-size", "8")
MAX_RESTART_TOKENS = 480  # prompt + output within the tiny model's 512 positions: 14 s of 30 ms steps


@pytest.fixture(scope="module")
def reference(model_folder):
    loaded = load_model(model_folder, dtype="fp32")
    cache = {}

    def solo(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in cache:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            cache[key] = reference_tokens(loaded, list(prompt), params)
        return cache[key]

    return solo


def start_system(model_folder: str, gpu_kv_blocks: int = 24, step_delay_ms: int = 0, *router_flags: str,
                 kv_transport: str = "auto", engine_flags: tuple[str, ...] = ()):
    """The three daemons (the engines start in parallel); step_delay_ms slows every engine step (a
    test-only fault) so that requests are still running when a test acts on them. kv_transport:
    the engines' KV data plane for hand-offs and migrations (auto: shared memory here, tcp: the data socket)."""
    env = {"DUALPACE_FAULT_STEP_DELAY_MS": str(step_delay_ms)} if step_delay_ms else None
    flags = ("--model", model_folder, *ENGINE_FLAGS, "--kv-transport", kv_transport, *engine_flags)
    with ThreadPoolExecutor(2) as pool:
        gpu = pool.submit(start_daemon, "gpu_service", *flags, "--kv-blocks", str(gpu_kv_blocks), env=env)
        cpu = pool.submit(start_daemon, "cpu_service", *flags, "--kv-blocks", "2048", "--assist", "never", env=env)
    gpu, cpu = gpu.result(), cpu.result()
    return gpu, cpu, start_router(model_folder, gpu, cpu, *router_flags)


def start_router(model_folder: str, gpu, cpu, *flags: str):
    return start_daemon("router", "serve", "--gpu", gpu.address, "--cpu", cpu.address, "--model", model_folder, *flags)


def request(prompt: list[int], max_tokens: int, request_id: str | None = None) -> router_pb2.GenerateRequest:
    message = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(token_ids=prompt),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    if request_id is not None:
        message.request_id = request_id
    return message


class Streams:
    """Run requests through the router in threads; keep tokens, engines and errors."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.tokens: dict[str, list[int]] = {}
        self.engines: dict[str, set[str]] = {}
        self.finish: dict[str, int] = {}
        self.errors: dict[str, grpc.RpcError] = {}
        self.threads: list[threading.Thread] = []

    def start(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.tokens[request_id], self.engines[request_id] = [], set()

        def run() -> None:
            try:
                for response in self.stub.Generate(request(prompt, max_tokens, request_id), timeout=180):
                    self.tokens[request_id].extend(response.token_ids)
                    if response.token_ids:
                        self.engines[request_id].add(response.engine)
                    if response.finish_reason:
                        self.finish[request_id] = response.finish_reason
            except grpc.RpcError as exc:
                self.errors[request_id] = exc

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout_s: float = 180) -> None:
        for thread in self.threads:
            thread.join(timeout_s)

    def placements(self):
        return self.stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10)

    def wait_tokens(self, request_id: str, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens[request_id]) < count and time.monotonic() < deadline:
            time.sleep(0.01)


def prompts(count: int) -> dict[str, list[int]]:
    return {f"q{i}": [(i * 13 + j * 7) % 500 + 1 for j in range(3 + i % 9)] for i in range(count)}


@pytest.mark.parametrize("kv_transport", ["auto", "tcp"])
def test_both_engines_used_with_migrations_and_exact_outputs(model_folder, reference, kv_transport):
    gpu, cpu, router = start_system(model_folder, gpu_kv_blocks=24, kv_transport=kv_transport)
    try:
        streams = Streams(router.address)
        requests = prompts(16)
        kinds_seen: set[str] = set()
        for request_id, prompt in requests.items():
            streams.start(request_id, prompt, 120)
        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in streams.threads) and time.monotonic() < deadline:
            placed = streams.placements()
            kinds = {e.name: e.kind for e in placed.engines}
            kinds_seen |= {kinds.get(r.engine) for r in placed.requests}
            time.sleep(0.1)
        streams.join()
        assert not streams.errors, streams.errors
        for request_id, prompt in requests.items():
            assert streams.tokens[request_id] == reference(tuple(prompt), 120), request_id
        assert {common_pb2.ENGINE_KIND_GPU, common_pb2.ENGINE_KIND_CPU} <= kinds_seen
        migrations = streams.placements().migrations
        assert any(m.outcome == router_pb2.MIGRATION_OUTCOME_COMMITTED for m in migrations)
        # Which data plane carried the hand-offs: the GPU engine maps the CPU engine's pool only for shm.
        assert ("mapped the KV pool" in gpu.log()) == (kv_transport == "auto")
    finally:
        for daemon in (router, cpu, gpu):
            assert daemon.stop() == 0, daemon.log()


def test_router_restart_keeps_engine_requests_and_rebuilds_placement(model_folder):
    """Kill the router mid-stream, start a new one: the engines kept running the requests and the
    new router's placement view shows them. Slowed steps (a test-only fault) keep them running
    for the whole test without the CPU time of a larger model."""
    # The lease outlives any router start-up on a loaded machine: this test is about re-attaching
    # within it (test_orphan_lease covers its expiry). No grace: the requests still running at
    # the end are aborted at the stop, not drained.
    gpu, cpu, router = start_system(model_folder, 256, 30, engine_flags=("--orphan-timeout-s", "600", "--grace-s", "0"))
    try:
        streams = Streams(router.address)
        for request_id, prompt in prompts(4).items():
            streams.start(request_id, prompt, MAX_RESTART_TOKENS)
        for request_id in streams.tokens:
            streams.wait_tokens(request_id, 3)
        router.kill()
        streams.join()
        router = start_router(model_folder, gpu, cpu)
        placed = Streams(router.address).placements()
        assert {r.request_id for r in placed.requests} == set(streams.tokens)
        assert {e.name for e in placed.engines} == {"gpu", "cpu"}
        progress = {r.request_id: r.generated_tokens for r in placed.requests}
        later = dict(progress)
        hang_guard = time.monotonic() + 120.0  # only against a hang: each request must advance, however slowly
        done = MAX_RESTART_TOKENS  # a request gone from the placements has finished
        while time.monotonic() < hang_guard and not all(later.get(rid, done) > n for rid, n in progress.items()):
            time.sleep(0.5)
            later = {r.request_id: r.generated_tokens for r in Streams(router.address).placements().requests}
        assert all(later.get(rid, done) > count for rid, count in progress.items()), (progress, later)
    finally:
        for daemon in (router, cpu, gpu):
            daemon.stop()


@pytest.mark.parametrize("build, field", [
    (lambda: router_pb2.GenerateRequest(text="", sampling=common_pb2.SamplingParams(max_tokens=4)), "text"),
    (lambda: router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)), "prompt"),
    (lambda: router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=-1)),
     "temperature"),
    (lambda: router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=4, top_p=1.5)),
     "top_p"),
    (lambda: router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda: request([5] * 600, 4), "prompt_token_ids"),
    (lambda: request([5, 99999], 4), "prompt_token_ids"),
    (lambda: request([5, 6], 4, request_id="bad id with spaces"), "request_id"),
])
def test_bad_input_names_the_field(model_folder, build, field, router_system):
    gpu, cpu, router = router_system
    with grpc.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(build(), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
        assert list(stub.Generate(request([5, 6], 3), timeout=30))[-1].finish_reason


@pytest.fixture(scope="module")
def router_system(model_folder):
    daemons = start_system(model_folder)
    yield daemons
    for daemon in reversed(daemons):
        assert daemon.stop() == 0, daemon.log()
