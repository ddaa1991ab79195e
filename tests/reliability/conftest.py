"""Shared setup of the reliability suite: real daemons on 127.0.0.1
ephemeral ports serving a tiny synthetic model, clients that read whole streams on
threads, and probes of an engine's KV and request table.

Every daemon runs with `--threads 1`; modules start theirs once (module-scoped
fixtures, in parallel where several are needed) and stop them at the end. Every
wait is bounded.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reliability.near_tie import near_tie_finder
from tests.reliability.system_specs import SystemSpec
from toolkit.engine_client import EngineClient
from dualpace.generation import OfflineGenerator
from dualpace.model.loader import load_model
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.common import finish_reason_from_pb
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.helpers import wait_for
from toolkit.processes import Daemon, start_all, start_daemon, stop_all

ENGINE_FLAGS = ("--dtype", "fp32", "--threads", "1")
RPC_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


# ---------------------------------------------------------------------- daemons


def start_gpu(folder: str, *flags: str, step_delay_ms: int = 0, env: dict[str, str] | None = None) -> Daemon:
    env = dict(env or {})
    if step_delay_ms:
        env["DUALPACE_FAULT_STEP_DELAY_MS"] = str(step_delay_ms)
    return start_daemon("gpu_service", "--model", folder, *ENGINE_FLAGS, *flags, env=env)


def start_cpu(folder: str, *flags: str, step_delay_ms: int = 0, env: dict[str, str] | None = None) -> Daemon:
    env = dict(env or {})
    if step_delay_ms:
        env["DUALPACE_FAULT_STEP_DELAY_MS"] = str(step_delay_ms)
    return start_daemon("cpu_service", "--model", folder, *ENGINE_FLAGS, "--assist", "never", *flags, env=env)


def start_router(folder: str, gpu: Daemon | None, cpu: Daemon | None, *flags: str) -> Daemon:
    engines = [*(("--gpu", gpu.address) if gpu else ()), *(("--cpu", cpu.address) if cpu else ())]
    return start_daemon("router", "serve", *engines, "--model", folder, *flags)


def assert_clean_exit(daemons: Iterable[Daemon]) -> None:
    """Stop them; every one that was still alive must exit 0 on SIGTERM."""
    daemons = [d for d in daemons if d.process.poll() is None]
    codes = stop_all(daemons)
    failed = [(d.log()[-3000:]) for d in daemons if codes[d.process.pid] != 0]
    assert not failed, f"daemons exited with a non-zero status:\n{failed}"


@pytest.fixture(scope="session")
def reference(tiny_folder) -> Callable[..., list[int]]:
    """reference(prompt, max_tokens, folder=tiny) -> the greedy output of the request run
    alone in-process (ignore_eos; cached)."""
    models: dict[str, object] = {}
    cache: dict[tuple, list[int]] = {}

    def run(prompt: Iterable[int], max_tokens: int, folder: str | None = None) -> list[int]:
        folder = folder or tiny_folder
        key = (folder, tuple(prompt), max_tokens)
        if key not in cache:
            if folder not in models:
                models[folder] = load_model(folder, dtype="fp32")
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            cache[key] = list(OfflineGenerator(models[folder]).generate([list(prompt)], [params])[0]
                              .output_token_ids)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def near_tie_position() -> Callable[..., int | None]:
    """near_tie_position(folder, prompt, tokens): tests/reliability/near_tie.py."""
    return near_tie_finder()


# ---------------------------------------------------------------------- systems


@dataclass
class System:
    """A running SystemSpec (tests/reliability/system_specs.py): its daemons, a probe of each engine, a channel and stub to the router."""

    folder: str
    engines: dict[str, Daemon]
    router: Daemon | None
    probes: dict[str, EngineProbe] = field(default_factory=dict)
    channel: grpc.Channel | None = None
    stub: router_pb2_grpc.RouterStub | None = None

    @cached_property
    def http(self) -> str:
        """The router's HTTP front (needs --http-listen among its flags), from its log line."""
        found = wait_for(lambda: HTTP_LISTENING.search(self.router.log()), bool, STOP_TIMEOUT_S, interval_s=0.05)
        assert found, self.router.log()  # printed right after the gRPC line
        return "http://" + found.group(1)


HTTP_LISTENING = re.compile(r"http listening on (\S+)")


@contextmanager
def running(folder: str, spec: SystemSpec) -> Iterator[System]:
    """Starts the engines in parallel, then the router; at the end every daemon still alive
    (a test may have killed some) must exit 0 on SIGTERM."""
    starters = {engine.kind: start_gpu if engine.kind == "gpu" else start_cpu for engine in spec.engines}
    engines = start_all(**{e.name: (lambda e=e: starters[e.kind](folder, *e.flags, step_delay_ms=e.step_delay_ms))
                           for e in spec.engines})
    system = System(folder, engines, None)
    try:
        if spec.router_flags is not None:
            behind = {e.kind: engines[e.name] for e in spec.engines if e.behind_router}
            system.router = start_router(folder, behind.get("gpu"), behind.get("cpu"), *spec.router_flags)
            system.channel = grpc.insecure_channel(system.router.address)
            system.stub = router_stub(system.channel)
        system.probes = {name: EngineProbe(daemon.address) for name, daemon in engines.items()}
        yield system
    finally:
        for probe in system.probes.values():
            probe.close()
        if system.channel is not None:
            system.channel.close()
        assert_clean_exit([d for d in (system.router, *engines.values()) if d is not None])


@pytest.fixture(scope="session")
def shared_systems(tiny_folder) -> Iterator[Callable[[SystemSpec], System]]:
    """shared_systems(spec) -> that system, started on first use and stopped at the session's end."""
    systems: dict[SystemSpec, System] = {}
    with ExitStack() as stack:
        def get(spec: SystemSpec) -> System:
            if spec not in systems:
                systems[spec] = stack.enter_context(running(tiny_folder, spec))
            return systems[spec]

        yield get


def _spec(request) -> SystemSpec:
    return getattr(request, "param", None) or request.module.SYSTEM


@pytest.fixture(scope="module")
def system(request, tiny_folder, shared_systems) -> Iterator[System]:
    """The module's SYSTEM (or the spec a test passes), once per module (per session if shared)."""
    spec = _spec(request)
    if spec.shared:
        yield shared_systems(spec)
        return
    with running(tiny_folder, spec) as started:
        yield started


@pytest.fixture
def fresh_system(request, tiny_folder) -> Iterator[System]:
    """A system of its own for one test (one that drains, kills or stops its daemons)."""
    with running(tiny_folder, _spec(request)) as started:
        yield started


# ---------------------------------------------------------------------- probes


class EngineProbe(EngineClient):
    """The benchmarks' engine client plus the reads the tests assert on."""

    def blocks_used(self) -> int:
        return self.load().kv_blocks_used

    def requests(self) -> dict[str, engine_pb2.RequestInfo]:
        listing = self.stub.ListRequests(engine_pb2.ListRequestsRequest(), timeout=10)
        return {info.request_id: info for info in listing.requests}

    def info(self) -> engine_pb2.EngineInfo:
        return self.stub.Info(engine_pb2.InfoRequest(), timeout=10)

    def health(self) -> int:
        return health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                             timeout=10).status

    def wait_idle(self, timeout_s: float = 10.0) -> engine_pb2.LoadSnapshot:
        """The load once no request is held and no KV block is used (or when the time is up)."""
        return wait_for(self.load, lambda s: s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0,
                        timeout_s)

    def assert_serving_and_generates(self, request_id: str, max_tokens: int = 3) -> None:
        assert self.health() == health_pb2.HealthCheckResponse.SERVING
        stream = EngineStream.run(self.stub, request_id, [3, 1, 4, 1, 5], max_tokens)
        assert stream.wait(RPC_TIMEOUT_S)
        assert stream.error is None, stream.error
        assert stream.finish_reason == FinishReason.LENGTH and len(stream.tokens) == max_tokens


# ---------------------------------------------------------------------- streams


@dataclass
class Stream:
    """One server-streaming call read to its end on a thread."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    migrated_to: str = ""
    engines: set[str] = field(default_factory=set)
    error: grpc.RpcError | None = None
    problems: list[str] = field(default_factory=list)  # gaps, repeats, messages after the last
    started_s: float = field(default_factory=time.monotonic)
    ended_s: float | None = None
    call: object = None
    first_token: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def wait(self, timeout_s: float = RPC_TIMEOUT_S) -> bool:
        return self.done.wait(timeout_s)

    def wait_tokens(self, count: int, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < count and not self.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        return len(self.tokens) >= count

    def cancel(self) -> None:
        self.call.cancel()

    @property
    def code(self) -> grpc.StatusCode | None:
        return None if self.error is None else self.error.code()

    def _read(self, call, check_index: bool) -> None:
        try:
            for response in call:
                if self.finish_reason is not None or self.migrated_to:
                    self.problems.append("a message came after the last one")
                if check_index and response.token_ids and response.first_token_index != len(self.tokens):
                    self.problems.append(f"message starts at {response.first_token_index}, "
                                         f"expected {len(self.tokens)}")
                self.tokens.extend(response.token_ids)
                if response.token_ids:
                    self.engines.add(response.engine)
                    self.first_token.set()
                self.finish_reason = finish_reason_from_pb(response.finish_reason)
                self.migrated_to = getattr(response, "migrated_to", "")
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended_s = time.monotonic()
            self.first_token.set()
            self.done.set()

    def _start(self, call, check_index: bool) -> Stream:
        self.call = call
        self.thread = threading.Thread(target=self._read, args=(call, check_index), daemon=True)
        self.thread.start()
        return self


class EngineStream(Stream):
    @classmethod
    def run(cls, stub: engine_pb2_grpc.EngineStub, request_id: str, prompt: list[int], max_tokens: int,
            keep_running: bool = False, timeout_s: float = RPC_TIMEOUT_S, **sampling) -> EngineStream:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        call = stub.Generate(new_request_to_pb(request_id, prompt, params, keep_running_on_disconnect=keep_running),
                             timeout=timeout_s)
        return cls(request_id)._start(call, check_index=True)


def router_request(prompt: list[int], max_tokens: int, request_id: str | None = None,
                   **sampling) -> router_pb2.GenerateRequest:
    message = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(token_ids=prompt),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                            **sampling))
    if request_id is not None:
        message.request_id = request_id
    return message


class RouterStream(Stream):
    @classmethod
    def run(cls, stub: router_pb2_grpc.RouterStub, request_id: str, prompt: list[int], max_tokens: int,
            timeout_s: float = RPC_TIMEOUT_S) -> RouterStream:
        call = stub.Generate(router_request(prompt, max_tokens, request_id), timeout=timeout_s)
        return cls(request_id)._start(call, check_index=False)


@contextmanager
def cancelled_if_unfinished(streams: Iterable[Stream]) -> Iterator[None]:
    """Whatever happens inside, no stream is left running afterwards (a failed test cancels them)."""
    try:
        yield
    finally:
        for stream in streams:
            if not stream.done.is_set():
                stream.cancel()


def assert_exact(streams: dict[str, Stream], prompts: dict[str, list[int]], max_tokens: int,
                 reference: Callable[..., list[int]], context: str = "") -> None:
    """Every stream finished LENGTH without an error, its tokens the solo greedy run's."""
    for rid, stream in streams.items():
        assert stream.error is None, (rid, stream.error, context)
        assert stream.finish_reason == FinishReason.LENGTH, rid
        assert stream.tokens == reference(prompts[rid], max_tokens), rid


def router_stub(channel: grpc.Channel) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(channel)


def prompt_for(index: int, length: int = 6) -> list[int]:
    """A distinct small prompt (ids within the tiny models' vocabularies)."""
    return [(index * 13 + j * 7) % 500 + 1 for j in range(length)]
