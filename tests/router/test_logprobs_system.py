"""Logprobs and penalties through the three daemons as real processes (gRPC router): a first
request fills gpu_service's KV (and is checked there); the next ones, too large for what is
left, are prefilled there and handed to cpu_service after their first token (a migration mid-generation), which decodes them locally or with Dense Assist; then
cpu_service is killed mid-stream and the router recovers the requests on gpu_service
(prompt + outputs re-submitted). Every logprob equals transformers' on the same checkpoint and
greedy output with penalties equals the reference implementation of vLLM's formulas."""

from __future__ import annotations

import threading

import grpc
import pytest

from dualpace.sampling import SamplingParams
from dualpace.wire.common import sampling_params_to_pb
from dualpace.wire.logprob_messages import logprobs_list_from_pb
from dualpace.wire.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.engine.test_logprobs_penalties import (
    BIAS,
    PROMPT,
    assert_entry_matches,
    assert_output_logprobs,
    hf_log_probs,
    hf_model,  # noqa: F401 (fixture)
    reference_greedy,
)
from toolkit.processes import start_daemon

ENGINE_FLAGS = ("--dtype", "fp32", "--threads", "1", "--block-size", "8")
MAX_TOKENS = 170  # prompt + 170: 23 blocks of 8; gpu_service has 48: room for one beside its reserve
FILLER = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=5, logprobs=3,
                         prompt_logprobs=2)
PENALIZED = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=BIAS, presence_penalty=0.6,
                           frequency_penalty=-0.4, repetition_penalty=1.3, logprobs=0)


@pytest.fixture(scope="module")
def expected_penalized(hf_model):  # noqa: F811
    return reference_greedy(hf_model, PROMPT, PENALIZED, set())


class Stream:
    """One request through the router in a thread: its tokens, logprobs, engines and error."""

    def __init__(self, stub, request_id: str, params: SamplingParams):
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.engines: set[str] = set()
        self.error: grpc.RpcError | None = None
        message = router_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=common_pb2.TokenIds(
            token_ids=PROMPT), sampling=sampling_params_to_pb(params))
        self.thread = threading.Thread(target=self._run, args=(stub, message))
        self.thread.start()

    def _run(self, stub, message) -> None:
        try:
            for response in stub.Generate(message, timeout=300):
                self.token_ids.extend(response.token_ids)
                self.logprobs.extend(logprobs_list_from_pb(response.logprobs))
                if response.prompt_logprobs:
                    assert self.prompt_logprobs is None  # sent once
                    self.prompt_logprobs = logprobs_list_from_pb(response.prompt_logprobs)
                if response.token_ids:
                    self.engines.add(response.engine)
        except grpc.RpcError as exc:
            self.error = exc


def check(hf_model, filler: Stream, sampled: Stream, penalized: Stream, expected_penalized) -> None:  # noqa: F811
    for stream in (filler, sampled, penalized):
        stream.thread.join(300)
        assert not stream.thread.is_alive() and stream.error is None, stream.error
    assert len(sampled.token_ids) == len(filler.token_ids) == MAX_TOKENS
    assert_output_logprobs(hf_model, PROMPT, filler.token_ids, filler.logprobs, 2)
    assert_output_logprobs(hf_model, PROMPT, sampled.token_ids, sampled.logprobs, 3)
    reference = hf_log_probs(hf_model, PROMPT)
    assert len(sampled.prompt_logprobs) == len(PROMPT) - 1
    for position, entry in enumerate(sampled.prompt_logprobs, start=1):
        assert_entry_matches(entry, reference[position - 1], PROMPT[position], 2)
    assert penalized.token_ids == expected_penalized
    assert_output_logprobs(hf_model, PROMPT, penalized.token_ids, penalized.logprobs, 0)


def start_requests(stub) -> tuple[Stream, Stream, Stream]:
    """The filler first (on the idle gpu_service), then the two that go to cpu_service."""
    filler = Stream(stub, "filler", FILLER)
    while filler.thread.is_alive() and not filler.token_ids:  # hang guard only: placed once it has a token
        filler.thread.join(0.02)
    return filler, Stream(stub, "sampled", SAMPLED), Stream(stub, "penalized", PENALIZED)


def start_system(model_folder: str, assist: str, step_delay_ms: int = 0):
    env = {"DUALPACE_FAULT_STEP_DELAY_MS": str(step_delay_ms)} if step_delay_ms else None
    gpu = start_daemon("gpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "48", env=env)
    cpu = start_daemon("cpu_service", "--model", model_folder, *ENGINE_FLAGS, "--kv-blocks", "512",
                       "--assist", assist, "--gpu-service", gpu.address, env=env)
    router = start_daemon("router", "serve", "--gpu", gpu.address, "--cpu", cpu.address, "--model", model_folder,
                          "--no-migrate")
    return gpu, cpu, router


@pytest.mark.parametrize("assist", ["never", "always"])
def test_handed_off_requests_on_cpu_service(model_folder, hf_model, expected_penalized, assist):  # noqa: F811
    gpu, cpu, router = start_system(model_folder, assist)
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            filler, sampled, penalized = start_requests(stub)
            check(hf_model, filler, sampled, penalized, expected_penalized)
        assert filler.engines == {"gpu"}
        assert sampled.engines == penalized.engines == {"gpu", "cpu"}  # first token on the GPU, the rest on the CPU
        if assist == "always":
            assert "iterations now run assisted" in cpu.log()
    finally:
        for daemon in (router, cpu, gpu):
            assert daemon.stop() == 0, daemon.log()


def test_recovered_after_cpu_service_dies_mid_stream(model_folder, hf_model, expected_penalized):  # noqa: F811
    gpu, cpu, router = start_system(model_folder, "never", step_delay_ms=10)
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            filler, sampled, penalized = start_requests(stub)
            for stream in (sampled, penalized):  # hang guard only: each must reach cpu_service first
                while stream.thread.is_alive() and (len(stream.token_ids) < 20 or "cpu" not in stream.engines):
                    stream.thread.join(0.02)
            cpu.kill()
            check(hf_model, filler, sampled, penalized, expected_penalized)
        assert sampled.engines == penalized.engines == {"gpu", "cpu"}
        assert "recovering" in router.log()
    finally:
        router.stop()
        gpu.stop()
        cpu.stop()
