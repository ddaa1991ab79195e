"""`ignore_eos` ignores every end token, and the request shapes benchmark clients send are counted
exactly. Real daemons on the tiny model: gpu_service with a pool of 8 blocks of 8
tokens (64), cpu_service with a large one, the router with its HTTP front and without load-driven
migration, so where a request runs follows from its size: one that fits the GPU pool alone runs
there when the GPU engine is idle, a larger one on the CPU engine (which prefills it itself), and
concurrent ones that do not fit the GPU pool together are prefilled there and handed off (a
migration). Every step is slowed by a test-only fault so that concurrent requests overlap.

`logit_bias` +100 on one end token makes it the greedy choice at every step: without ignore_eos
the output is that one token (finish "stop"); with it, exactly max_tokens tokens (finish
"length"), whichever end token it is: EOS, the generation config's end ids or the chat template's
end of turn (the tokenizer's chat stop ids hold them all).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from dualpace.model.tokenizer import Tokenizer
from dualpace.wire.router_messages import placements_to_dict
from dualpace.wire.v1 import common_pb2, router_pb2
from tests.helpers import wait_for
from tests.reliability.conftest import running
from tests.reliability.system_specs import EngineSpec, SystemSpec

HANG_GUARD_S = 120.0
GPU_POOL_TOKENS = 8 * 8
FORCED_BIAS = 100


SPEC = SystemSpec(
    engines=(EngineSpec("gpu", "gpu", ("--name", "gpu-eos", "--block-size", "8", "--kv-blocks", "8"), step_delay_ms=10),
             EngineSpec("cpu", "cpu", ("--name", "cpu-eos", "--block-size", "8", "--kv-blocks", "512"),
                        step_delay_ms=10)),
    router_flags=("--no-migrate", "--http-listen", "127.0.0.1:0"))


@pytest.fixture(scope="module")
def system(tiny_folder):
    """(http base URL, router gRPC stub, model folder, tokenizer)."""
    with running(tiny_folder, SPEC) as started:
        yield started.http, started.stub, tiny_folder, Tokenizer.from_path(tiny_folder)


def post(http: str, path: str, body: dict) -> dict | list[dict]:
    """The JSON answer, or for a stream the list of its data events (up to [DONE])."""
    request = urllib.request.Request(http + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            if not body.get("stream"):
                return json.loads(response.read())
            events = []
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return events
                events.append(json.loads(data))
            raise AssertionError(f"the stream ended without [DONE]: {events[-3:]}")
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code}: {exc.read().decode()}") from None


def chat_body(model: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Answer yes or no: is water wet?"}],
            "max_completion_tokens": max_tokens, "temperature": 0, **extra}


def completion_body(model: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": "Answer yes or no: is water wet?", "max_tokens": max_tokens,
            "temperature": 0, **extra}


def answer_of(answer: dict | list[dict]) -> tuple[int, str]:
    """(completion tokens, finish reason) of a whole answer or of a stream with usage."""
    if isinstance(answer, dict):
        return answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
    reasons = [c["choices"][0]["finish_reason"] for c in answer if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(reasons) == 1, answer
    assert answer[-1]["choices"] == [], "the last chunk must carry the usage"
    return answer[-1]["usage"]["completion_tokens"], reasons[0]


def wait_gpu_idle(stub) -> None:
    """Until the router sees no KV block in use on the GPU engine: an idle engine takes any request
    that fits its whole pool (its load view lags a finished request by up to one update)."""
    def gpu_used() -> int:
        engines = placements_to_dict(stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10))["engines"]
        return next(e["kv_blocks_used"] for e in engines if e["name"] == "gpu-eos")

    assert wait_for(gpu_used, lambda used: used == 0, HANG_GUARD_S, interval_s=0.05) == 0


def prompt_tokens(tokenizer: Tokenizer, chat: bool) -> int:
    if chat:
        return len(tokenizer.encode_chat([{"role": "user", "content": "Answer yes or no: is water wet?"}]))
    return len(tokenizer.encode("Answer yes or no: is water wet?", add_special_tokens=True))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("engine", ["gpu", "cpu"])
def test_ignore_eos_ignores_every_end_token(system, chat, engine):
    http, stub, model, tokenizer = system
    num_prompt = prompt_tokens(tokenizer, chat)
    # gpu: fits the GPU pool alone (reserved at prompt + max_tokens); cpu: does not fit it at all.
    max_tokens = GPU_POOL_TOKENS - num_prompt if engine == "gpu" else GPU_POOL_TOKENS + 2 - num_prompt
    assert max_tokens >= 8, num_prompt
    path, shape = ("/v1/chat/completions", chat_body) if chat else ("/v1/completions", completion_body)
    end_ids = tokenizer.chat_stop_token_ids if chat else tokenizer.eos_token_ids
    assert end_ids
    for end_id in end_ids:
        forced = {"logit_bias": {str(end_id): FORCED_BIAS}}
        assert answer_of(post(http, path, shape(model, max_tokens, **forced))) == (1, "stop"), end_id
        wait_gpu_idle(stub)
        answer = post(http, path, shape(model, max_tokens, ignore_eos=True, **forced))
        assert answer_of(answer) == (max_tokens, "length"), end_id
    wait_gpu_idle(stub)
    streamed = post(http, path, shape(model, max_tokens, ignore_eos=True, logit_bias={str(end_ids[-1]): FORCED_BIAS},
                                      stream=True, stream_options={"include_usage": True}))
    assert answer_of(streamed) == (max_tokens, "length")


def test_ignore_eos_on_the_grpc_front_and_where_it_ran(system):
    _, stub, _, tokenizer = system
    num_prompt = prompt_tokens(tokenizer, chat=True)
    messages = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user",
                                                                        content="Answer yes or no: is water wet?")])
    for engine, max_tokens in (("gpu-eos", GPU_POOL_TOKENS - num_prompt), ("cpu-eos", GPU_POOL_TOKENS + 2 - num_prompt)):
        for end_id in tokenizer.chat_stop_token_ids:
            wait_gpu_idle(stub)
            sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                 logit_bias={end_id: FORCED_BIAS})
            replies = list(stub.Generate(router_pb2.GenerateRequest(messages=messages, sampling=sampling),
                                         timeout=HANG_GUARD_S))
            assert sum(len(r.token_ids) for r in replies) == max_tokens, (engine, end_id)
            assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, (engine, end_id)
            assert {r.engine for r in replies if r.token_ids} == {engine}, (engine, end_id)


def test_client_stop_ids_and_strings_still_apply_with_ignore_eos(system):
    http, _, model, tokenizer = system
    end_id = tokenizer.chat_stop_token_ids[0]
    forced = {"logit_bias": {str(end_id): FORCED_BIAS}, "ignore_eos": True}
    answer = post(http, "/v1/chat/completions", chat_body(model, 20, stop_token_ids=[end_id], **forced))
    assert answer_of(answer) == (1, "stop")
    whole = post(http, "/v1/completions", completion_body(model, 20, ignore_eos=True))
    text = whole["choices"][0]["text"]
    assert text.strip(), whole
    stop = text[len(text) // 2:][:2].strip() or text[-1]
    stopped = post(http, "/v1/completions", completion_body(model, 20, ignore_eos=True, stop=[stop]))
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == text[:text.index(stop)]


def test_ignore_eos_across_a_hand_off(system):
    """Concurrent chat requests that do not fit the GPU pool together: those placed on the CPU
    engine are prefilled on the GPU engine and migrated; each returns exactly max_tokens."""
    http, stub, model, tokenizer = system
    max_tokens = GPU_POOL_TOKENS // 2
    end_id = tokenizer.chat_stop_token_ids[0]
    ids = [f"eos-handoff-{i}" for i in range(4)]
    answers: dict[str, object] = {}

    def run(request_id: str, stream: bool) -> None:
        options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        try:
            answers[request_id] = answer_of(post(http, "/v1/chat/completions", chat_body(
                model, max_tokens, ignore_eos=True, request_id=request_id,
                logit_bias={str(end_id): FORCED_BIAS}, **options)))
        except AssertionError as exc:
            answers[request_id] = exc

    threads = [threading.Thread(target=run, args=(rid, i % 2 == 0)) for i, rid in enumerate(ids)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert answers == {rid: (max_tokens, "length") for rid in ids}
    migrations = placements_to_dict(stub.ListPlacements(router_pb2.ListPlacementsRequest(), timeout=10))["migrations"]
    moved = {m["request_id"] for m in migrations if m["outcome"] == "committed" and m["to_engine"] == "cpu-eos"}
    assert moved & set(ids), migrations


# ---------------------------------------------------------------------- the clients' request shapes

PROMPT = "Write a long story about a lighthouse keeper and the sea."
OUTPUT_TOKENS = 24
TEXT_PARTS = [{"type": "text", "text": PROMPT}]
# The bodies each client sends for a fixed output length (their source, recent releases): guidellm's
# openai_http backend; `vllm bench serve` (--ignore-eos); aiperf (--extra-inputs ignore_eos:true).
SHAPES = {
    "guidellm-chat": ("/v1/chat/completions", {
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": OUTPUT_TOKENS, "stop": None, "ignore_eos": True,
        "messages": [{"role": "user", "content": TEXT_PARTS}]}),
    "guidellm-completions": ("/v1/completions", {
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": OUTPUT_TOKENS, "stop": None, "ignore_eos": True, "prompt": PROMPT}),
    "vllm-bench-chat": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": TEXT_PARTS}], "temperature": 0.0,
        "max_completion_tokens": OUTPUT_TOKENS, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True}),
    "vllm-bench-completions": ("/v1/completions", {
        "prompt": PROMPT, "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": OUTPUT_TOKENS,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    "aiperf-chat": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": OUTPUT_TOKENS,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    "aiperf-chat-whole": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": TEXT_PARTS}], "max_completion_tokens": OUTPUT_TOKENS,
        "ignore_eos": True}),
}


@pytest.mark.parametrize("client", list(SHAPES))
def test_benchmark_clients_count_exactly(system, client):
    http, _, model, tokenizer = system
    path, shape = SHAPES[client]
    chat = path == "/v1/chat/completions"
    num_prompt = len(tokenizer.encode_chat([{"role": "user", "content": PROMPT}]) if chat
                     else tokenizer.encode(PROMPT, add_special_tokens=True))
    answer = post(http, path, {"model": model, **shape})
    if isinstance(answer, dict):
        assert answer["usage"]["prompt_tokens"] == num_prompt
        assert answer_of(answer) == (OUTPUT_TOKENS, "length")
        return
    assert answer_of(answer) == (OUTPUT_TOKENS, "length")
    final = answer[-1]["usage"]
    assert (final["prompt_tokens"], final["total_tokens"]) == (num_prompt, num_prompt + OUTPUT_TOKENS)
    content = [c for c in answer if c["choices"]]
    if shape["stream_options"].get("continuous_usage_stats"):
        # vLLM's shape: every chunk carries the usage so far; the counts only grow, up to the total.
        counts = [c["usage"]["completion_tokens"] for c in content]
        assert all(c["usage"]["prompt_tokens"] == num_prompt for c in content)
        assert counts == sorted(counts) and counts[-1] == OUTPUT_TOKENS, counts
    else:
        assert all(c["usage"] is None for c in content)
    key = "delta" if chat else None
    texts = [(c["choices"][0][key].get("content") if key else c["choices"][0]["text"]) or "" for c in content]
    if "temperature" in shape:  # greedy: the streamed text is the whole answer's
        whole = post(http, path, {"model": model, **{k: v for k, v in shape.items()
                                                       if k not in ("stream", "stream_options")}})
        text = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
        assert "".join(texts) == text
        assert whole["usage"]["completion_tokens"] == OUTPUT_TOKENS
