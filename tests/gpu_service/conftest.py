"""gpu_service daemons shared by the system tests, and the client helpers they use.

Daemons are real subprocesses on 127.0.0.1 ephemeral ports serving the tiny
synthetic model (fp32, one thread). Each kind is started at most once per
session, on first use; a module asks for all the kinds it needs at once
(`gpu_daemons.start(...)`) so they load in parallel. At the end of the session
every daemon is stopped with SIGTERM and must exit with status 0.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dualpace.generation import OfflineGenerator
from dualpace.model.loader import load_model
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.common import finish_reason_from_pb
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from tests.helpers import wait_for
from toolkit.processes import Daemon, start_daemon

COMMON_FLAGS = ("--dtype", "fp32", "--threads", "1", "--kv-transport", "auto")  # -tcp kinds override it
# The tiny model has 3 layers (0, 1, 2): each fault below hits a layer the transfer has.
# (A cut "after 3" layers would never trigger on the data socket.)
FAULT_LAYER = 2
DAEMON_SPECS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    # Most tests, and the source of the successful migrations.
    "main": (("--name", "gpu-main", "--kv-blocks", "256", "--block-size", "8"), {}),
    # Migration target; a different block size (the KV goes in token order, not by block).
    "peer": (("--name", "gpu-peer", "--kv-blocks", "128", "--block-size", "16"), {}),
    # A KV pool too small for all requests at once: queueing and preemption.
    "small": (("--name", "gpu-small", "--kv-blocks", "12", "--block-size", "8", "--max-batch-tokens", "32"), {}),
    # One running and one waiting request at most: the next gets RESOURCE_EXHAUSTED.
    "queue": (("--name", "gpu-queue", "--max-running", "1", "--max-waiting", "1"), {}),
    # Migration sources whose outgoing KV transfers fail. Without CUDA the pools are in host
    # memory, so a source with --kv-transport auto sends through shared memory; the -tcp kinds
    # stream the layers over the target's TCP data socket (dualpace.faults: what each fault does on each).
    "corrupt": (("--name", "gpu-corrupt", "--block-size", "8"),
                {"DUALPACE_FAULT_KV_CORRUPT_LAYER": str(FAULT_LAYER)}),
    "drop": (("--name", "gpu-drop", "--block-size", "8"), {"DUALPACE_FAULT_KV_DROP_LAYER": str(FAULT_LAYER)}),
    "cut": (("--name", "gpu-cut", "--block-size", "8"),
            {"DUALPACE_FAULT_KV_CUT_AFTER_LAYERS": str(FAULT_LAYER)}),
    # Migrates only to the peers it lists, none of which is a daemon here: every MigrateOut is refused.
    "guarded": (("--name", "gpu-guarded", "--block-size", "8", "--peer", "localhost:1",
                 "--peer", "unix:/nonexistent/dualpace-peer.sock"), {}),
}
for _kind in ("main", "corrupt", "drop", "cut"):
    _flags, _env = DAEMON_SPECS[_kind]
    DAEMON_SPECS[f"{_kind}-tcp"] = (_flags + ("--kv-transport", "tcp"), _env)  # the cross-host data socket
KV_TRANSPORTS = {"shm": "", "tcp": "-tcp"}  # transport -> suffix of the source kinds that use it
STOP_TIMEOUT_S = 30.0
RPC_TIMEOUT_S = 60.0


@dataclass
class GpuDaemons:
    """Lazily started gpu_service daemons, one per kind, with a cached channel each."""

    model_folder: str
    daemons: dict[str, Daemon] = field(default_factory=dict)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def start(self, *names: str) -> list[Daemon]:
        """Start the named daemons that are not running yet (in parallel) and return all of them."""
        missing = [name for name in dict.fromkeys(names) if name not in self.daemons]
        if missing:
            with ThreadPoolExecutor(len(missing)) as pool:
                futures = {name: pool.submit(self._start_one, name) for name in missing}
            errors = []
            for name, future in futures.items():
                try:
                    self.daemons[name] = future.result()
                except Exception as exc:  # noqa: BLE001 - report every failed start at once
                    errors.append(f"{name}: {exc}")
            if errors:
                raise RuntimeError("gpu_service did not start:\n" + "\n".join(errors))
        return [self.daemons[name] for name in names]

    def _start_one(self, name: str) -> Daemon:
        flags, env = DAEMON_SPECS[name]
        return start_daemon("gpu_service", "--model", self.model_folder, *COMMON_FLAGS, *flags, env=env)

    def address(self, name: str) -> str:
        return self.start(name)[0].address

    def stub(self, name: str) -> engine_pb2_grpc.EngineStub:
        if name not in self.channels:
            self.channels[name] = grpc.insecure_channel(self.address(name))
        return engine_pb2_grpc.EngineStub(self.channels[name])

    def stop_all(self) -> dict[str, tuple[int | None, str]]:
        """SIGTERM every daemon at once, wait for each; name -> (exit status, log)."""
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()
        for daemon in self.daemons.values():
            if daemon.process.poll() is None:
                daemon.process.send_signal(signal.SIGTERM)
        results = {}
        for name, daemon in self.daemons.items():
            try:
                daemon.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                daemon.kill()
            results[name] = (daemon.process.returncode, daemon.log())
        self.daemons.clear()
        return results


@pytest.fixture(scope="session")
def gpu_daemons(tiny_folder):
    daemons = GpuDaemons(tiny_folder)
    try:
        yield daemons
    finally:
        results = daemons.stop_all()
    failed = {name: (code, log[-3000:]) for name, (code, log) in results.items() if code != 0}
    assert not failed, f"daemons exited with a non-zero status: {failed}"


@pytest.fixture(scope="session")
def tiny_model(tiny_folder):
    return load_model(tiny_folder, dtype="fp32")


@pytest.fixture(scope="session")
def solo(tiny_model) -> Callable[[list[int], SamplingParams], list[int]]:
    """solo(prompt, params) -> output token ids of the request run alone in-process (cached)."""
    cache: dict[tuple, list[int]] = {}

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = list(OfflineGenerator(tiny_model).generate([list(prompt)], [params])[0].output_token_ids)
        return cache[key]

    return run


# ---------------------------------------------------------------------- client helpers


@dataclass
class StreamResult:
    tokens: list[int]
    finish_reason: FinishReason | None
    migrated_to: str
    num_messages: int
    completion_tokens: int


def read_stream(responses: Iterable[engine_pb2.EngineGenerateResponse], request_id: str,
                first_index: int = 0, tokens: list[int] | None = None) -> StreamResult:
    """Read a Generate stream to its end, checking that no token is missing or repeated."""
    tokens = [] if tokens is None else tokens
    finish, migrated_to, count, completion = None, "", 0, 0
    for response in responses:
        count += 1
        assert response.request_id == request_id
        assert finish is None and not migrated_to, "a message came after the last one"
        assert response.first_token_index == first_index + len(tokens) or not response.token_ids, \
            f"gap or repeat: message starts at {response.first_token_index}, expected {first_index + len(tokens)}"
        tokens.extend(response.token_ids)
        finish = finish_reason_from_pb(response.finish_reason)
        migrated_to = response.migrated_to
        completion = response.usage.completion_tokens
    return StreamResult(tokens, finish, migrated_to, count, completion)


def read_first_tokens(call, request_id: str) -> list[int]:
    """Read messages of a live Generate call until it has produced at least one token."""
    tokens: list[int] = []
    for response in call:
        assert response.request_id == request_id and response.first_token_index == len(tokens)
        assert not response.finish_reason and not response.migrated_to, "the request ended too soon"
        tokens.extend(response.token_ids)
        if tokens:
            return tokens
    raise AssertionError("the stream ended without a token")


def generate(stub: engine_pb2_grpc.EngineStub, request_id: str, prompt: list[int],
             params: SamplingParams) -> StreamResult:
    return read_stream(stub.Generate(new_request_to_pb(request_id, prompt, params), timeout=RPC_TIMEOUT_S),
                       request_id)


def start_generate(stub: engine_pb2_grpc.EngineStub, request_id: str, prompt: list[int], params: SamplingParams):
    return stub.Generate(new_request_to_pb(request_id, prompt, params), timeout=RPC_TIMEOUT_S)


def blocks_used(stub: engine_pb2_grpc.EngineStub) -> int:
    return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10).kv_blocks_used


def listed_ids(stub: engine_pb2_grpc.EngineStub) -> list[str]:
    return [r.request_id for r in stub.ListRequests(engine_pb2.ListRequestsRequest(), timeout=10).requests]


def wait_idle(stub: engine_pb2_grpc.EngineStub, timeout_s: float = 2.0) -> int:
    """kv_blocks_used once it reaches 0 (or whatever it is when the time is up)."""
    return wait_for(lambda: blocks_used(stub), lambda used: used == 0, timeout_s)


def assert_healthy(address: str, stub: engine_pb2_grpc.EngineStub, request_id: str) -> None:
    """Health says SERVING and a small valid request runs to its end."""
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    result = generate(stub, request_id, [3, 1, 4, 1, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    assert result.finish_reason == FinishReason.LENGTH and len(result.tokens) == 3
