"""KV migration between two real gpu_service processes, and transfers that fail.

Every test runs on both data planes: shared memory (the sources' default on one host) and the TCP
data socket (sources started with --kv-transport tcp).

A client reads the source's stream until it ends with migrated_to, then resumes
on the target from the number of tokens it has seen: the two parts together
equal the request run alone, with no gap or repeat. A transfer broken by an
injected fault fails MigrateOut; the request keeps running on the source and
finishes as if nothing happened, and neither side keeps a KV block.
"""

from __future__ import annotations

import grpc
import pytest

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.v1 import engine_pb2
from tests.gpu_service.conftest import (
    FAULT_LAYER,
    KV_TRANSPORTS,
    RPC_TIMEOUT_S,
    listed_ids,
    read_first_tokens,
    read_stream,
    start_generate,
    wait_idle,
)

# Long enough that the request is still decoding when MigrateOut arrives right
# after its first token (a few ms against hundreds of steps).
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(30)]
MAX_TOKENS = 400
PARAMS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                             ignore_eos=True),
}
FAULT_SOURCES = ("corrupt", "drop", "cut")
MAX_ATTEMPTS = 3  # new request if one finished before MigrateOut reached it


@pytest.fixture(scope="module")
def daemons(gpu_daemons):
    for suffix in KV_TRANSPORTS.values():  # in two rounds: fewer processes loading at once on a small machine
        gpu_daemons.start("peer", *(kind + suffix for kind in ("main", *FAULT_SOURCES)))
    return gpu_daemons


@pytest.fixture(scope="module")
def num_layers(daemons) -> int:
    return daemons.stub("main").Info(engine_pb2.InfoRequest(), timeout=10).num_layers


def migrate_out(daemons, source: str, request_id: str):
    return daemons.stub(source).MigrateOut(
        engine_pb2.MigrateOutRequest(request_id=request_id, target_address=daemons.address("peer")),
        timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("transport", sorted(KV_TRANSPORTS))
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_migrated_stream_equals_solo_run(daemons, solo, num_layers, mode, transport):
    params = PARAMS[mode]
    source_kind = "main" + KV_TRANSPORTS[transport]
    source, target = daemons.stub(source_kind), daemons.stub("peer")
    request_id = response = None
    for attempt in range(MAX_ATTEMPTS):
        request_id = f"move-{mode}-{transport}-{attempt}"
        call = start_generate(source, request_id, PROMPT, params)
        seen = read_first_tokens(call, request_id)
        try:
            response = migrate_out(daemons, source_kind, request_id)
            break
        except grpc.RpcError as exc:
            # Only acceptable failure: the request already finished (nothing to move).
            assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
            assert read_stream(call, request_id, tokens=seen).finish_reason == FinishReason.LENGTH
    assert response is not None, f"every request finished before MigrateOut ({MAX_ATTEMPTS} tries)"
    assert response.target_engine == "gpu-peer"
    assert response.total_bytes > 0
    assert response.transport == transport

    before = read_stream(call, request_id, tokens=seen)
    assert before.finish_reason is None
    assert before.migrated_to == daemons.address("peer")
    assert request_id not in listed_ids(source)

    resume = engine_pb2.EngineGenerateRequest(
        resume=engine_pb2.ResumeEngineRequest(request_id=request_id, from_token_index=len(before.tokens)))
    after = read_stream(target.Generate(resume, timeout=RPC_TIMEOUT_S), request_id, first_index=len(before.tokens))
    assert after.finish_reason == FinishReason.LENGTH
    assert after.completion_tokens == MAX_TOKENS
    assert before.tokens + after.tokens == solo(PROMPT, params)
    assert len(after.tokens) > 0

    assert wait_idle(source) == 0
    assert wait_idle(target) == 0
    assert request_id not in listed_ids(target)


@pytest.mark.parametrize("transport", sorted(KV_TRANSPORTS))
@pytest.mark.parametrize("fault", FAULT_SOURCES)
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_failed_transfer_keeps_request_on_source(daemons, solo, num_layers, fault, mode, transport):
    assert FAULT_LAYER < num_layers, "the fault must hit a layer the transfer has"
    params = PARAMS[mode]
    source_kind = fault + KV_TRANSPORTS[transport]
    source, target = daemons.stub(source_kind), daemons.stub("peer")
    request_id = error = None
    for attempt in range(MAX_ATTEMPTS):
        request_id = f"{fault}-{mode}-{transport}-{attempt}"
        call = start_generate(source, request_id, PROMPT, params)
        seen = read_first_tokens(call, request_id)
        with pytest.raises(grpc.RpcError) as caught:
            migrate_out(daemons, source_kind, request_id)
        if caught.value.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: finished first; try again
            error = caught.value
            break
        assert read_stream(call, request_id, tokens=seen).finish_reason == FinishReason.LENGTH
    assert error is not None, f"every request finished before MigrateOut ({MAX_ATTEMPTS} tries)"
    # A transfer the target rejected or the link lost: UNAVAILABLE (the target's status is in the
    # message), never INTERNAL, whichever write or read on the source first noticed the end.
    assert error.code() == grpc.StatusCode.UNAVAILABLE, \
        f"{error}\nsource log:\n{daemons.daemons[source_kind].log()[-4000:]}"

    # The request never left: the same stream carries on to the end.
    result = read_stream(call, request_id, tokens=seen)
    assert result.finish_reason == FinishReason.LENGTH and not result.migrated_to
    assert result.tokens == solo(PROMPT, params)

    assert wait_idle(source) == 0
    assert wait_idle(target) == 0
    assert request_id not in listed_ids(target)
    assert request_id not in listed_ids(source)


def test_migrate_out_to_an_unlisted_target_is_refused(daemons, solo):
    """A target that is not one of the source's --peer: PERMISSION_DENIED before anything is
    paused or sent; the request runs on to the end where it is, greedy-identical."""
    source, target = daemons.stub("guarded"), daemons.stub("peer")
    params = PARAMS["greedy"]
    call = start_generate(source, "unlisted", PROMPT, params)
    seen = read_first_tokens(call, "unlisted")
    with pytest.raises(grpc.RpcError) as caught:
        daemons.stub("guarded").MigrateOut(
            engine_pb2.MigrateOutRequest(request_id="unlisted", target_address=daemons.address("peer")),
            timeout=RPC_TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
    assert "--peer" in caught.value.details() and daemons.address("peer") in caught.value.details()
    result = read_stream(call, "unlisted", tokens=seen)
    assert result.finish_reason == FinishReason.LENGTH and not result.migrated_to
    assert result.tokens == solo(PROMPT, params)
    assert wait_idle(source) == 0 and wait_idle(target) == 0
    assert "unlisted" not in listed_ids(target)
