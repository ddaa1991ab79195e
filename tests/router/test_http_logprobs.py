"""Logprobs, echo and penalties through the router's OpenAI HTTP front, with the official `openai`
client against `dualpace up` (three real daemons on the tiny model): the shapes of chat and
completions answers, streamed and not, values equal to transformers' on the same checkpoint,
and bad values answered 400 naming the field while the router stays healthy."""

from __future__ import annotations

import math

import pytest
import torch

from dualpace.model.tokenizer import Tokenizer
from tests.router.test_http_api import client, raw  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

TOLERANCE = 1e-4
PROMPT_IDS = [1, 17, 33, 49, 65, 81, 97, 113, 129]


@pytest.fixture(scope="module")
def hf_model(model_folder):  # noqa: F811
    return transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_folder):  # noqa: F811
    return Tokenizer.from_path(model_folder)


def hf_log_probs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=1)


def hf_greedy(hf_model, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(hf_log_probs(hf_model, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_completions_logprobs_whole_and_streamed(client, model_folder, hf_model, tokenizer):  # noqa: F811
    args = {"model": model_folder, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0.9, "seed": 11,
            "logprobs": 3, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    whole = client.completions.create(**args)
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    # Tokens named "token_id:N" (several tiny-model tokens decode to the same text): every value
    # of the sampled path is checked against transformers.
    output = [int(text.removeprefix("token_id:")) for text in logprobs.tokens]
    reference = hf_log_probs(hf_model, PROMPT_IDS + output)
    for i, token_id in enumerate(output):
        row = reference[len(PROMPT_IDS) + i - 1]
        assert abs(logprobs.token_logprobs[i] - float(row[token_id])) < TOLERANCE
        top_values, top_ids = torch.topk(row, 3)
        top = logprobs.top_logprobs[i]
        assert len(top) in (3, 4) and f"token_id:{token_id}" in top
        for t, value in zip(top_ids.tolist(), top_values.tolist()):
            assert abs(top[f"token_id:{t}"] - value) < TOLERANCE
    plain = client.completions.create(**{**args, "extra_body": {"ignore_eos": True}})
    assert plain.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in output]  # same seed, same draw
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]

    chunks = list(client.completions.create(**args, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    values = [v for lp in streamed for v in lp.token_logprobs]
    assert max(abs(a - b) for a, b in zip(values, logprobs.token_logprobs)) < TOLERANCE
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset


def test_completions_echo_with_logprobs(client, model_folder, hf_model, tokenizer):  # noqa: F811
    whole = client.completions.create(model=model_folder, prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                      logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    prompt_text = tokenizer.decode(PROMPT_IDS)
    assert choice.text.startswith(prompt_text)
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    output = hf_greedy(hf_model, PROMPT_IDS, 3)
    reference = hf_log_probs(hf_model, PROMPT_IDS + output)
    ids = PROMPT_IDS + output
    for position in range(1, len(ids)):
        assert abs(lp.token_logprobs[position] - float(reference[position - 1][ids[position]])) < TOLERANCE
    streamed = list(client.completions.create(model=model_folder, prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                              logprobs=2, echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    plain = client.completions.create(model=model_folder, prompt="Hello there", max_tokens=2, temperature=0,
                                      echo=True, extra_body={"ignore_eos": True})
    assert plain.choices[0].text.startswith("Hello there") and plain.choices[0].logprobs is None


def test_chat_logprobs_whole_and_streamed(client, model_folder, hf_model, tokenizer):  # noqa: F811
    messages = [{"role": "user", "content": "Count to three."}]
    args = {"model": model_folder, "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 4, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    prompt = tokenizer.encode_chat(messages)
    output = hf_greedy(hf_model, prompt, len(content))
    reference = hf_log_probs(hf_model, prompt + output)
    assert "".join(e.token for e in content) == tokenizer.decode(output)
    for i, (entry, token_id) in enumerate(zip(content, output)):
        row = reference[len(prompt) + i - 1]
        assert entry.token == tokenizer.decode([token_id]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(row[token_id])) < TOLERANCE
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the top one
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert abs(values[0] - float(row.max())) < TOLERANCE

    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < TOLERANCE
    plain = client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_penalties_over_http_change_greedy_output(client, model_folder):  # noqa: F811
    args = {"model": model_folder, "prompt": PROMPT_IDS, "max_tokens": 16, "temperature": 0}
    biased = client.completions.create(**args, logit_bias={"11": 6}, extra_body={"ignore_eos": True})
    penalized = client.completions.create(**args, logit_bias={"11": 6}, presence_penalty=2, frequency_penalty=2,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.3,
                                                      "min_tokens": 4})
    assert biased.choices[0].text != penalized.choices[0].text
    assert penalized.usage.completion_tokens == 16


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": 30, "echo": True}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/chat/completions", {"min_tokens": 10}, "min_tokens"),  # more than max_tokens (4)
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
])
def test_bad_values_are_400_naming_the_field(up, model_folder, path, fields, param):  # noqa: F811
    body = {"model": model_folder, "max_tokens": 4}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, answer = raw(up, "POST", path, body | fields)
    assert status == 400, answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"], answer
    status, health = raw(up, "GET", "/health")
    assert status == 200 and health["status"] == "ok"


def test_logprobs_are_probabilities(client, model_folder):  # noqa: F811
    whole = client.completions.create(model=model_folder, prompt=PROMPT_IDS, max_tokens=4, temperature=1.0,
                                      seed=3, logprobs=20,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    for top in whole.choices[0].logprobs.top_logprobs:
        assert 20 <= len(top) <= 21 and all(v <= 0 for v in top.values())
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5


def check_against_hf(hf_model, prompt: list[int], tokens: list[str], values: list[float]) -> list[int]:
    """A choice's logprobs (tokens named "token_id:N") equal transformers' on its own tokens."""
    output = [int(text.removeprefix("token_id:")) for text in tokens]
    reference = hf_log_probs(hf_model, prompt + output)
    for i, token_id in enumerate(output):
        assert abs(values[i] - float(reference[len(prompt) + i - 1][token_id])) < TOLERANCE
    return output


def test_every_choice_of_n_carries_its_own_logprobs(client, model_folder, hf_model, tokenizer):  # noqa: F811
    args = {"model": model_folder, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2,
            "logprobs": 2, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    whole = client.completions.create(**args)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    outputs = []
    for choice in sorted(whole.choices, key=lambda c: c.index):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 6
        outputs.append(check_against_hf(hf_model, PROMPT_IDS, lp.tokens, lp.token_logprobs))
    assert outputs[0] != outputs[1]  # seeds derived per choice
    single = client.completions.create(**{**args, "n": 1})
    assert single.choices[0].logprobs.tokens == whole.choices[0].logprobs.tokens  # choice 0 is the n = 1 answer
    streamed = {0: [], 1: []}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs:
                streamed[choice.index].extend(choice.logprobs.tokens)
    assert streamed == {c.index: c.logprobs.tokens for c in whole.choices}

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model_folder, messages=messages, max_tokens=5, temperature=1.0,
                                          seed=9, n=2, logprobs=True, top_logprobs=1,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    prompt = tokenizer.encode_chat(messages)
    for choice in chat.choices:
        content = choice.logprobs.content
        assert len(content) == 5 and all(len(e.top_logprobs) == 1 for e in content)
        check_against_hf(hf_model, prompt, [e.token for e in content], [e.logprob for e in content])


def test_echo_with_a_list_of_prompts_echoes_each_prompt(client, model_folder, tokenizer):  # noqa: F811
    prompts = ["Hello there", "The sky is"]
    whole = client.completions.create(model=model_folder, prompt=prompts, max_tokens=2, temperature=0, echo=True,
                                      logprobs=1, extra_body={"ignore_eos": True})
    by_index = sorted(whole.choices, key=lambda c: c.index)
    assert len(by_index) == 2
    for prompt, choice in zip(prompts, by_index):
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(tokenizer.encode(prompt)) + 2
        assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])


def test_best_of_answers_the_candidates_of_highest_cumulative_logprob(client, model_folder):  # noqa: F811
    args = {"model": model_folder, "prompt": PROMPT_IDS, "max_tokens": 5, "temperature": 1.0, "seed": 21,
            "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    # The same seeded candidates, all shown: candidate i samples with seed + i either way.
    every = client.completions.create(**args, n=4, logprobs=0)
    cumulative = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    assert len(cumulative) == 4  # distinct candidates, so the ranking is observable
    ranked = sorted(cumulative, key=cumulative.get, reverse=True)
    best = client.completions.create(**args, n=2, best_of=4)
    assert [c.text for c in best.choices] == ranked[:2] and [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # asked of the engine for ranking only
    assert best.usage.completion_tokens == 4 * 5  # every candidate was generated
    shown = client.completions.create(**args, n=1, best_of=4, logprobs=1)
    assert shown.choices[0].text == ranked[0] and len(shown.choices[0].logprobs.tokens) == 5
