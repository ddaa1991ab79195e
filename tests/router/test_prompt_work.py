"""Prompt work off the router's event loop: an oversized prompt is refused
before any tokenizing, naming the limit; tokenizing runs in the bounded prompt pool, and the
event loop keeps running other work while a slow one is in progress (order, not time)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dualpace.errors import InvalidArgument
from dualpace.model.loader import load_tokenizer_and_config
from dualpace.sampling_params import SamplingParams
from dualpace.client_request import ClientRequest
from router.prompt_work import REQUEST_SLACK_BYTES, PromptLimits, PromptWork

HANG_GUARD_S = 60.0


def client(text=None, messages=None) -> ClientRequest:
    return ClientRequest(request_id=None, text=text, prompt_token_ids=None, messages=messages,
                         params=SamplingParams(max_tokens=4))


class RecordingTokenizer:
    """Wraps a real tokenizer: records the thread each encode runs on; can hold encodes until released."""

    def __init__(self, tokenizer, hold: bool = False):
        self._tokenizer = tokenizer
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(HANG_GUARD_S)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def tiny(synth_checkpoint):
    return load_tokenizer_and_config(str(synth_checkpoint("tiny-llama")))


async def test_an_oversized_prompt_is_refused_naming_the_limit_without_tokenizing(tiny):
    tokenizer, config = tiny
    recording = RecordingTokenizer(tokenizer)
    work = PromptWork(PromptLimits(max_prompt_chars=100))
    try:
        with pytest.raises(InvalidArgument) as raised:
            await work.prepare(client(text="x" * 101), recording, config)
        assert raised.value.field == "text" and "--max-prompt-chars" in raised.value.problem
        assert "at most 100" in raised.value.problem
        with pytest.raises(InvalidArgument) as raised:
            await work.prepare(client(messages=[{"role": "user", "content": "y" * 60}] * 2), recording, config)
        assert raised.value.field == "messages"
        assert recording.threads == []  # nothing was tokenized
        ids, _ = await work.prepare(client(text="x" * 100), recording, config)  # at the limit: taken
        assert ids == tokenizer.encode("x" * 100, add_special_tokens=True)
    finally:
        work.close()


async def test_tokenizing_runs_in_the_pool_and_the_loop_keeps_running(tiny):
    tokenizer, config = tiny
    recording = RecordingTokenizer(tokenizer, hold=True)
    work = PromptWork(PromptLimits(num_workers=1))
    try:
        prepared = asyncio.ensure_future(work.prepare(client(text="hello there"), recording, config))
        assert await asyncio.to_thread(recording.entered.wait, HANG_GUARD_S)
        ticks = 0
        for _ in range(5):  # the event loop runs other work while the prompt is being tokenized
            await asyncio.sleep(0)
            ticks += 1
        assert ticks == 5 and not prepared.done()
        recording.release.set()
        ids, params = await asyncio.wait_for(prepared, HANG_GUARD_S)
        assert ids == tokenizer.encode("hello there", add_special_tokens=True)
        assert params.seed is not None
        assert recording.threads and all(name.startswith("router-prompt") for name in recording.threads)
    finally:
        recording.release.set()
        work.close()


def test_limits_must_be_positive():
    with pytest.raises(InvalidArgument, match="--max-prompt-chars"):
        PromptLimits(max_prompt_chars=0)
    with pytest.raises(InvalidArgument, match="--prompt-workers"):
        PromptLimits(num_workers=0)
    with pytest.raises(InvalidArgument, match="--max-request-bytes"):
        PromptLimits(max_request_bytes=0)
    with pytest.raises(InvalidArgument, match="--max-request-bytes"):
        PromptLimits(max_request_bytes=1 << 31)


def test_the_receive_bound_leaves_room_for_any_prompt_within_the_limit():
    """4 bytes per character (UTF-8's most) plus the rest of the request, unless set explicitly."""
    limits = PromptLimits(max_prompt_chars=1000)
    longest = "\U0001F600" * 1000  # 4 bytes each in UTF-8
    assert len(longest.encode()) == 4000 and limits.receive_bytes == 4000 + REQUEST_SLACK_BYTES
    assert PromptLimits(max_prompt_chars=1000, max_request_bytes=5000).receive_bytes == 5000
    assert PromptLimits(max_prompt_chars=1 << 30).receive_bytes == (1 << 31) - 1  # gRPC's largest


def test_a_chat_turn_ends_at_its_end_of_turn_unless_ignore_eos(tiny):
    """The chat template's end-of-turn ids join the client's stop ids; with ignore_eos they do not,
    and the client's own stop_token_ids stay."""
    from router.prompts import prepare_prompt

    tokenizer, config = tiny
    messages = [{"role": "user", "content": "hi"}]
    for ignore_eos, expected in ((False, {7, *tokenizer.chat_stop_token_ids}), (True, {7})):
        params = SamplingParams(max_tokens=4, stop_token_ids=(7,), ignore_eos=ignore_eos)
        _, prepared = prepare_prompt(ClientRequest(request_id=None, text=None, prompt_token_ids=None,
                                                   messages=messages, params=params), tokenizer, config)
        assert set(prepared.stop_token_ids) == expected, ignore_eos
