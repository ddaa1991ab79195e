"""Streaming ids -> text without re-decoding the whole output on every token.

A token may end in the middle of a UTF-8 character (byte-level vocabularies
split emoji and CJK across tokens), and a decoder may join tokens in ways that
decoding one token alone gets wrong (sentencepiece's leading `▁`). So each push
decodes a short trailing window twice: once up to the last emitted position
(`read_offset`) and once to the end, both starting at `prefix_offset`, a token
or more earlier for context. The new text is the difference. Text ending in
U+FFFD is held back until the character completes. Work per push is
proportional to the window, not to the output length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded ahead of the first generated token, for decoder context.
_NUM_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one push at a time.

    The concatenation of all pushes and `flush()` equals
    `tokenizer.decode(generated ids)` (for vocabularies whose decoder strips a
    leading space, the first generated token keeps the space it has after the
    prompt). A push never ends in a broken character; `flush()` returns what is
    still held, U+FFFD included if the model really produced invalid bytes.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = False
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._token_ids: list[int] = context_ids
        self._num_context_ids = len(context_ids)
        self._prefix_offset = 0
        self._read_offset = len(context_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    @property
    def generated_token_ids(self) -> list[int]:
        """Every id pushed so far."""
        return self._token_ids[self._num_context_ids :]

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self._token_ids.extend(token_ids)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """Return all text still held back (at the end of the stream)."""
        return self._advance(hold_incomplete=False)

    def _advance(self, *, hold_incomplete: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        full_text = self._decode(self._prefix_offset, len(self._token_ids))
        if hold_incomplete and full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        if not full_text.startswith(self._prefix_text):
            # A decoder rewrote the window's earlier text; the longest common
            # prefix is what was already emitted, so only the rest is new.
            common = _common_prefix_length(full_text, self._prefix_text)
            new_text = full_text[common:]
        else:
            new_text = full_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return new_text

    def _decode(self, start: int, stop: int) -> str:
        if start == stop:
            return ""
        return self._tokenizer.decode(self._token_ids[start:stop], skip_special_tokens=self._skip_special_tokens)


def _common_prefix_length(a: str, b: str) -> int:
    length = 0
    for char_a, char_b in zip(a, b):
        if char_a != char_b:
            break
        length += 1
    return length
