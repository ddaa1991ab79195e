"""Streaming detokenization: deltas are whole characters and add up to the full decode."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpace.model.detokenizer import IncrementalDetokenizer
from dualpace.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MULTI_BYTE_TEXT = "Emoji 😀🎉👍🏽 and 👨‍👩‍👧, CJK 中文字符测试、日本語のテキスト, accents café Ωμέγα.\n"


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer) -> Tokenizer:
    return default_tokenizer


def _stream(tokenizer: Tokenizer, token_ids: list[int], sizes: list[int], prompt_ids=()) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_ids)
    deltas, start = [], 0
    for size in sizes:
        deltas.append(detokenizer.push(token_ids[start : start + size]))
        start += size
    deltas.append(detokenizer.push(token_ids[start:]))
    deltas.append(detokenizer.flush())
    return deltas


def test_one_token_at_a_time(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(MULTI_BYTE_TEXT)
    # The text has characters split across tokens, so holding back is exercised.
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in token_ids)
    deltas = _stream(tokenizer, token_ids, [1] * len(token_ids))
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(token_ids) == MULTI_BYTE_TEXT


def test_with_prompt_context(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": "Say hi in Chinese"}])
    token_ids = tokenizer.encode("你好 😀 hello<|im_end|>")
    deltas = _stream(tokenizer, token_ids, [1] * len(token_ids), prompt_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids)


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("hi 😀<|im_end|>")
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    text = "".join(detokenizer.push([token_id]) for token_id in token_ids) + detokenizer.flush()
    assert text == "hi 😀"
    assert detokenizer.generated_token_ids == token_ids


def test_invalid_bytes_are_released_at_flush(tokenizer: Tokenizer) -> None:
    lead_byte_id = tokenizer.encode("😀")[0]  # a token holding only the first bytes of the emoji
    assert tokenizer.decode([lead_byte_id]).endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(tokenizer.encode("ok ")) == "ok "
    assert detokenizer.push([lead_byte_id]) == ""
    assert detokenizer.flush() == tokenizer.decode([lead_byte_id])
    assert detokenizer.flush() == ""


def test_window_stays_small(tokenizer: Tokenizer) -> None:
    """Each push decodes a few tokens, however long the output already is."""
    decoded_lengths: list[int] = []

    class CountingDecoder:
        def decode(self, token_ids, skip_special_tokens=False):
            decoded_lengths.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens)

    token_ids = tokenizer.encode(MULTI_BYTE_TEXT * 20)
    _stream(CountingDecoder(), token_ids, [1] * len(token_ids))
    assert max(decoded_lengths) <= 8


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_split_sizes(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    token_ids = tokenizer.encode(MULTI_BYTE_TEXT * 2)
    sizes = []
    while sum(sizes) < len(token_ids):
        sizes.append(rng.randint(0, 5))
    deltas = _stream(tokenizer, token_ids, sizes)
    assert not any(delta.endswith("\ufffd") for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(token_ids)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_token_sequences(tokenizer: Tokenizer, data: st.DataObject) -> None:
    """Arbitrary orders of byte-fragment tokens: invalid UTF-8 included, deltas still add up."""
    pool = sorted(set(tokenizer.encode(MULTI_BYTE_TEXT)))
    token_ids = data.draw(st.lists(st.sampled_from(pool), max_size=40))
    sizes = data.draw(st.lists(st.integers(0, 4), max_size=len(token_ids)))
    deltas = _stream(tokenizer, token_ids, sizes)
    assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(token_ids)
