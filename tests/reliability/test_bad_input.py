"""Bad input at the router and at both engines, field by field.

Criteria: every bad field of GenerateRequest (router), NewEngineRequest / ResumeEngineRequest,
AbortRequest and MigrateOutRequest (engines) fails with INVALID_ARGUMENT whose details name
the field (NOT_FOUND naming the id for an unknown request), and the next valid request on the
same daemon succeeds.
"""

from __future__ import annotations

import itertools
import math

import grpc
import pytest

from dualpace.sampling import FinishReason
from dualpace.wire.v1 import common_pb2, engine_pb2, router_pb2
from tests.reliability.conftest import (
    EngineProbe,
    EngineStream,
    RouterStream,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec

VOCAB = 512  # the tiny model's
CONTEXT = 512
MAX_SEED = 2**63 - 1
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
_ids = itertools.count()

# Sampling fields, each bad value with the field its error must name; shared by every surface.
BAD_SAMPLING = {
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"max_tokens": -5}, "max_tokens"),
    "max_tokens past the context": ({"max_tokens": CONTEXT}, "max_tokens"),
    "temperature negative": ({"temperature": -0.5}, "temperature"),
    "temperature NaN": ({"temperature": math.nan}, "temperature"),
    "temperature inf": ({"temperature": math.inf}, "temperature"),
    "top_p 0": ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
    "top_p above 1": ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    "top_p negative": ({"temperature": 1.0, "top_p": -0.1}, "top_p"),
    "top_p NaN": ({"temperature": 1.0, "top_p": math.nan}, "top_p"),
    "top_k negative": ({"temperature": 1.0, "top_k": -1}, "top_k"),
    "min_p negative": ({"temperature": 1.0, "min_p": -0.1}, "min_p"),
    "min_p above 1": ({"temperature": 1.0, "min_p": 1.5}, "min_p"),
    "min_p NaN": ({"temperature": 1.0, "min_p": math.nan}, "min_p"),
    "seed past 2^63 - 1": ({"seed": MAX_SEED + 1}, "seed"),
    "seed 2^64 - 1": ({"seed": 2**64 - 1}, "seed"),
    "stop string empty": ({"stop": ["ok", ""]}, "stop"),
    "stop token id out of vocabulary": ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    "stop token id huge": ({"stop_token_ids": [2**32 - 1]}, "stop_token_ids"),
}
BAD_PROMPT_IDS = {
    "prompt empty": ([], "prompt_token_ids"),
    "token id = vocab size": ([1, VOCAB, 3], "prompt_token_ids"),
    "token id 2^32 - 1": ([2**32 - 1], "prompt_token_ids"),
    "prompt as long as the context": ([5] * CONTEXT, "prompt_token_ids"),
    "prompt past the context": ([5] * (CONTEXT + 88), "prompt_token_ids"),
}


SYSTEM = SystemSpec(engines=(
    EngineSpec("gpu", "gpu", ("--name", "gpu-bad", "--kv-blocks", "64", "--block-size", "8")),
    EngineSpec("cpu", "cpu", ("--name", "cpu-bad", "--kv-blocks", "64", "--block-size", "8")),
))


def expect_error(rpc, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        result = rpc()
        if not isinstance(result, engine_pb2.AbortResponse | engine_pb2.MigrateOutResponse):
            list(result)  # a stream: its status comes with its end
    error = caught.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    for word in words:
        assert word in error.details(), f"{word!r} not in {error.details()!r}"


def next_valid_on_engine(probe: EngineProbe) -> None:
    stream = EngineStream.run(probe.stub, f"ok-{next(_ids)}", [3, 1, 4], 3)
    assert stream.wait(60) and stream.error is None, stream.error
    assert stream.finish_reason == FinishReason.LENGTH and len(stream.tokens) == 3


def next_valid_on_router(router) -> None:
    stream = RouterStream.run(router, f"ok-{next(_ids)}", [3, 1, 4], 3)
    assert stream.wait(60) and stream.error is None, stream.error
    assert stream.finish_reason == FinishReason.LENGTH and len(stream.tokens) == 3


# ---------------------------------------------------------------------- engines


def engine_new(prompt=(1, 2, 3), request_id: str | None = None, **sampling) -> engine_pb2.EngineGenerateRequest:
    sampling.setdefault("max_tokens", 4)
    return engine_pb2.EngineGenerateRequest(new_request=engine_pb2.NewEngineRequest(
        request_id=f"bad-{next(_ids)}" if request_id is None else request_id, prompt_token_ids=list(prompt),
        sampling=common_pb2.SamplingParams(**sampling)))


def engine_resume(request_id: str, from_token_index: int = 0) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        resume=engine_pb2.ResumeEngineRequest(request_id=request_id, from_token_index=from_token_index))


ENGINE_CASES = {
    **{f"sampling: {name}": (lambda s=sampling: engine_new(**s), INVALID, (field,))
       for name, (sampling, field) in BAD_SAMPLING.items()},
    **{f"prompt: {name}": (lambda p=prompt: engine_new(prompt=p), INVALID, (field,))
       for name, (prompt, field) in BAD_PROMPT_IDS.items()},
    "request_id empty": (lambda: engine_new(request_id=""), INVALID, ("request_id",)),
    "neither new_request nor resume": (lambda: engine_pb2.EngineGenerateRequest(), INVALID, ("kind",)),
    "resume of an unknown id": (lambda: engine_resume("nobody-here"), NOT_FOUND, ("nobody-here",)),
    "resume with an empty id": (lambda: engine_resume(""), NOT_FOUND, ()),
}


@pytest.mark.parametrize("engine", ["gpu", "cpu"])
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_generate_bad_field(system, engine, case):
    probes = system.probes
    build, code, words = ENGINE_CASES[case]
    probe = probes[engine]
    expect_error(lambda: probe.stub.Generate(build(), timeout=30), code, *words)
    next_valid_on_engine(probe)


@pytest.mark.parametrize("engine", ["gpu", "cpu"])
def test_engine_requests_naming_a_live_or_unknown_request(system, engine):
    """Abort / MigrateOut / resume fields against an unknown id, and a live one where the
    mistake is another field (a duplicate id, a resume past the end, a missing target)."""
    probes = system.probes
    probe = probes[engine]
    expect_error(lambda: probe.stub.Abort(engine_pb2.AbortRequest(request_id="nobody-here"), timeout=10),
                 NOT_FOUND, "nobody-here")
    expect_error(lambda: probe.stub.Abort(engine_pb2.AbortRequest(request_id=""), timeout=10), NOT_FOUND)
    expect_error(lambda: probe.stub.MigrateOut(engine_pb2.MigrateOutRequest(
        request_id="nobody-here", target_address=probes["gpu"].address), timeout=30), NOT_FOUND, "nobody-here")
    expect_error(lambda: probe.stub.MigrateOut(engine_pb2.MigrateOutRequest(request_id="nobody-here"),
                                               timeout=30), INVALID, "target_address")

    live_id = f"live-{engine}"
    live = EngineStream.run(probe.stub, live_id, list(range(1, 11)), 480)
    try:
        assert live.wait_tokens(1)
        expect_error(lambda: probe.stub.Generate(engine_new(request_id=live_id), timeout=30),
                     INVALID, "request_id", live_id)
        expect_error(lambda: probe.stub.Generate(engine_resume(live_id, 10_000), timeout=30),
                     INVALID, "from_token_index")
        expect_error(lambda: probe.stub.MigrateOut(engine_pb2.MigrateOutRequest(request_id=live_id), timeout=30),
                     INVALID, "target_address")
        assert live_id in probe.requests(), "a bad request disturbed the live one"
        probe.stub.Abort(engine_pb2.AbortRequest(request_id=live_id), timeout=10)
        assert live.wait(30) and live.finish_reason == FinishReason.ABORT
    finally:
        if not live.done.is_set():
            live.cancel()
    assert probe.wait_idle().kv_blocks_used == 0
    next_valid_on_engine(probe)


# ---------------------------------------------------------------------- router


def router_ids(prompt, **sampling) -> router_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 4)
    return router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(token_ids=list(prompt)),
                                      sampling=common_pb2.SamplingParams(**sampling))


def router_text(text: str, **sampling) -> router_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 4)
    return router_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(**sampling))


def with_id(request_id: str) -> router_pb2.GenerateRequest:
    message = router_ids([1, 2, 3])
    message.request_id = request_id
    return message


ROUTER_CASES = {
    **{f"sampling: {name}": (lambda s=sampling: router_text("hello", **s), (field,))
       for name, (sampling, field) in BAD_SAMPLING.items()},
    **{f"prompt: {name}": (lambda p=prompt: router_ids(p), (field,))
       for name, (prompt, field) in BAD_PROMPT_IDS.items()},
    "no prompt": (lambda: router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)),
                  ("prompt",)),
    "text empty": (lambda: router_text(""), ("text",)),
    "text past the context": (lambda: router_text("hello world " * 400), ("text",)),
    "messages empty": (lambda: router_pb2.GenerateRequest(messages=router_pb2.ChatMessages(),
                                                          sampling=common_pb2.SamplingParams(max_tokens=4)),
                       ("messages",)),
    "request_id empty": (lambda: with_id(""), ("request_id",)),
    "request_id with spaces": (lambda: with_id("bad id"), ("request_id",)),
    "request_id too long": (lambda: with_id("x" * 129), ("request_id",)),
    "request_id with a newline": (lambda: with_id("a\nb"), ("request_id",)),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_generate_bad_field(system, case):
    router = system.stub
    build, words = ROUTER_CASES[case]
    expect_error(lambda: router.Generate(build(), timeout=30), INVALID, *words)
    next_valid_on_router(router)


def test_router_duplicate_request_id_while_running(system):
    probes, router = system.probes, system.stub
    live = RouterStream.run(router, "router-live", list(range(1, 11)), 480)
    try:
        assert live.wait_tokens(1), live.error
        expect_error(lambda: router.Generate(with_id("router-live"), timeout=30), INVALID, "request_id")
        assert not live.done.is_set(), "a bad request disturbed the live one"
    finally:
        live.cancel()
    assert live.wait(30)
    for probe in probes.values():
        assert probe.wait_idle().kv_blocks_used == 0
    next_valid_on_router(router)
