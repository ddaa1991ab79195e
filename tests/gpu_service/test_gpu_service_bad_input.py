"""Bad input over gRPC: the right status code, a message naming the field, and a
daemon that stays healthy (health SERVING, the next valid request runs)."""

from __future__ import annotations

import itertools
import math

import grpc
import pytest

from dualpace.sampling import SamplingParams
from dualpace.wire.v1 import common_pb2, engine_pb2
from tests.gpu_service.conftest import (
    RPC_TIMEOUT_S,
    assert_healthy,
    listed_ids,
    read_first_tokens,
    start_generate,
    wait_idle,
)
from tests.helpers import wait_for

_ids = itertools.count()
LONG_PARAMS = SamplingParams(max_tokens=480, ignore_eos=True)


@pytest.fixture(scope="module")
def daemons(gpu_daemons):
    gpu_daemons.start("main", "queue")
    return gpu_daemons


def new_request(prompt=(1, 2, 3), **sampling) -> engine_pb2.EngineGenerateRequest:
    sampling.setdefault("max_tokens", 4)
    return engine_pb2.EngineGenerateRequest(new_request=engine_pb2.NewEngineRequest(
        request_id=f"bad-{next(_ids)}", prompt_token_ids=list(prompt), sampling=common_pb2.SamplingParams(**sampling)))


def resume(request_id: str, from_token_index: int = 0) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        resume=engine_pb2.ResumeEngineRequest(request_id=request_id, from_token_index=from_token_index))


def expect_error(rpc, code: grpc.StatusCode, *words: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = rpc()
        if not isinstance(result, engine_pb2.AbortResponse | engine_pb2.MigrateOutResponse):
            list(result)  # a stream: its status comes with its end
    error = caught.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    for word in words:
        assert word in error.details(), f"{word!r} not in {error.details()!r}"
    return error


GENERATE_CASES = {
    "empty prompt": (new_request(prompt=()), grpc.StatusCode.INVALID_ARGUMENT, ("prompt",)),
    "prompt + max_tokens over the context": (new_request(prompt=range(1, 21), max_tokens=500),
                                             grpc.StatusCode.INVALID_ARGUMENT, ("max_tokens",)),
    "out-of-vocabulary token": (new_request(prompt=(1, 512, 3)), grpc.StatusCode.INVALID_ARGUMENT,
                                ("prompt", "512")),
    "negative temperature": (new_request(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, ("temperature",)),
    "NaN temperature": (new_request(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, ("temperature",)),
    "top_p 0": (new_request(temperature=1.0, top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, ("top_p",)),
    "top_p 1.5": (new_request(temperature=1.0, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, ("top_p",)),
    "resume of an unknown request": (resume("nobody"), grpc.StatusCode.NOT_FOUND, ("nobody",)),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_bad_generate(daemons, case):
    request, code, words = GENERATE_CASES[case]
    stub = daemons.stub("main")
    expect_error(lambda: stub.Generate(request, timeout=RPC_TIMEOUT_S), code, *words)
    assert_healthy(daemons.address("main"), stub, f"after-{next(_ids)}")


def test_abort_of_unknown_request(daemons):
    stub = daemons.stub("main")
    expect_error(lambda: stub.Abort(engine_pb2.AbortRequest(request_id="nobody"), timeout=10),
                 grpc.StatusCode.NOT_FOUND, "nobody")
    assert_healthy(daemons.address("main"), stub, f"after-{next(_ids)}")


def test_migrate_out_of_unknown_request(daemons):
    stub = daemons.stub("main")
    request = engine_pb2.MigrateOutRequest(request_id="nobody", target_address=daemons.address("queue"))
    expect_error(lambda: stub.MigrateOut(request, timeout=30), grpc.StatusCode.NOT_FOUND, "nobody")
    assert_healthy(daemons.address("main"), stub, f"after-{next(_ids)}")


def test_migrate_out_without_target(daemons):
    stub = daemons.stub("main")
    call = start_generate(stub, "no-target", list(range(1, 11)), LONG_PARAMS)
    try:
        read_first_tokens(call, "no-target")
        expect_error(lambda: stub.MigrateOut(engine_pb2.MigrateOutRequest(request_id="no-target"), timeout=30),
                     grpc.StatusCode.INVALID_ARGUMENT, "target_address")
    finally:
        call.cancel()
    assert wait_idle(stub) == 0
    assert_healthy(daemons.address("main"), stub, f"after-{next(_ids)}")


def test_duplicate_request_id_while_running(daemons):
    stub = daemons.stub("main")
    call = start_generate(stub, "twice", list(range(1, 11)), LONG_PARAMS)
    try:
        read_first_tokens(call, "twice")
        duplicate = engine_pb2.EngineGenerateRequest(new_request=engine_pb2.NewEngineRequest(
            request_id="twice", prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=4)))
        expect_error(lambda: stub.Generate(duplicate, timeout=RPC_TIMEOUT_S),
                     grpc.StatusCode.INVALID_ARGUMENT, "request_id", "twice")
        assert "twice" in listed_ids(stub)  # the first request is untouched
    finally:
        call.cancel()
    assert wait_idle(stub) == 0
    assert_healthy(daemons.address("main"), stub, f"after-{next(_ids)}")


def test_full_queue_is_resource_exhausted(daemons):
    """--max-running 1 --max-waiting 1: one request runs, one waits, the third is refused."""
    stub = daemons.stub("queue")
    prompt = list(range(1, 21))
    running = start_generate(stub, "q-running", prompt, LONG_PARAMS)
    waiting = None
    try:
        read_first_tokens(running, "q-running")
        waiting = start_generate(stub, "q-waiting", prompt, LONG_PARAMS)
        load = wait_for(lambda: stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10),
                        lambda snapshot: snapshot.num_waiting == 1, timeout_s=2)
        assert (load.num_running, load.num_waiting) == (1, 1)
        expect_error(lambda: stub.Generate(new_request(prompt=prompt), timeout=RPC_TIMEOUT_S),
                     grpc.StatusCode.RESOURCE_EXHAUSTED, "queue")
    finally:
        running.cancel()
        if waiting is not None:
            waiting.cancel()
    assert wait_idle(stub) == 0
    load = wait_for(lambda: stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10),
                    lambda snapshot: snapshot.num_running == snapshot.num_waiting == 0, timeout_s=2)
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert_healthy(daemons.address("queue"), stub, f"after-{next(_ids)}")
