"""The OpenAI front's log-probability and penalty fields: parsing them into
SamplingParams fields, and OpenAI's logprobs shapes in the answers. Pure (no aiohttp).

Requests:
- chat: `logprobs` (bool) and `top_logprobs` (0..20, needs logprobs true);
- completions: `logprobs` (0..20 alternatives) and `echo` (the prompt is returned before the
  completion; with logprobs, the prompt tokens' log-probabilities too: the first one is null);
- both: vLLM's return_tokens_as_token_ids (tokens are named "token_id:N", unambiguous where
  several tokens decode to the same text, e.g. the bytes of a split UTF-8 character), presence_penalty, frequency_penalty (-2..2), logit_bias ({"token id": -100..100}, at
  most 300), and vLLM's repetition_penalty (> 0) and min_tokens. Ranges are checked by
  SamplingParams.validate (the error names the client's field, see RENAMED_*).

Answers: completions' {tokens, token_logprobs, top_logprobs, text_offset} (top_logprobs maps each
token's text to its logprob, the sampled token included, as OpenAI and vLLM answer), chat's
{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}. A token's text is
the tokenizer's decoding of that token alone; text_offset counts characters of those texts from
the start of the choice's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dualpace.errors import InvalidArgument
from dualpace.logprobs import TokenLogprobs

RENAMED_CHAT = {"logprobs": "top_logprobs"}
RENAMED_COMPLETION = {"prompt_logprobs": "logprobs"}


def sampling_fields(body, chat: bool) -> dict:
    """SamplingParams keyword arguments from a request body (router.openai_schema._Body)."""
    fields = {
        "presence_penalty": body.number("presence_penalty", 0.0),
        "frequency_penalty": body.number("frequency_penalty", 0.0),
        "repetition_penalty": body.number("repetition_penalty", 1.0),
        "min_tokens": body.integer("min_tokens", 0),
        "logit_bias": _logit_bias(body.raw("logit_bias")),
    }
    body.boolean("return_tokens_as_token_ids", False)  # checked here; the answer reads it (tokens_as_ids)
    if chat:
        wanted = body.boolean("logprobs", False)
        top = body.integer("top_logprobs", None)
        if top is not None and not wanted:
            raise InvalidArgument("top_logprobs", "needs logprobs set to true")
        fields["logprobs"] = (top or 0) if wanted else None
    else:
        fields["logprobs"] = body.integer("logprobs", None)
        if body.boolean("echo", False) and fields["logprobs"] is not None:
            fields["prompt_logprobs"] = fields["logprobs"]
    return fields


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidArgument("logit_bias", "must be an object mapping token ids to biases")
    entries = []
    for key, bias in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidArgument("logit_bias", f"key {key!r} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or abs(bias) > 1e300:
            raise InvalidArgument("logit_bias", f"the bias of token {key} must be a number in [-100, 100], "
                                  f"got {bias!r}")
        entries.append((token_id, float(bias)))
    return tuple(sorted(entries))


@dataclass
class AnswerLogprobs:
    """One choice's logprobs and echo, accumulated over the relay's updates."""

    tokenizer: object
    chat: bool
    num_top: int | None  # None: no logprobs asked for
    echo_text: str | None  # completions with echo: the prompt's text
    prompt_token_ids: Sequence[int] = ()
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: each token's text is "token_id:N"
    entries: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)  # (token id, entry)
    _offset: int = 0  # text_offset of the next completion token
    _echo_logprobs_sent: bool = False
    _echo_text_sent: bool = False

    @classmethod
    def for_choice(cls, parsed, client, tokenizer, prompt_token_ids: Sequence[int]) -> AnswerLogprobs | None:
        """One choice's accumulator (None when the request asked for neither logprobs nor echo);
        client: the ClientRequest of that choice's prompt, whose text echo returns."""
        params = client.params
        echo = getattr(parsed, "echo", False)
        if params.logprobs is None and not echo:
            return None
        echo_text = None
        if echo:
            echo_text = client.text if client.text is not None else tokenizer.decode(prompt_token_ids)
        return cls(tokenizer, parsed.chat, params.logprobs, echo_text, prompt_token_ids,
                   getattr(parsed, "tokens_as_ids", False))

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self.tokenizer.decode([token_id])

    def take(self, update) -> dict | None:
        """The logprobs object of an update's tokens (and, first, the echoed prompt's), or None
        when logprobs were not asked for."""
        items: list[tuple[int, TokenLogprobs | None]] = []
        if self.echo_text is not None and not self._echo_logprobs_sent and update.prompt_logprobs is not None:
            items.append((self.prompt_token_ids[0], None))
            items.extend((entry.token_id, entry) for entry in update.prompt_logprobs)
            self._echo_logprobs_sent = True
        items.extend(zip(update.token_ids, update.logprobs or (None,) * len(update.token_ids)))
        self.entries.extend(items)
        if self.num_top is None:
            return None
        return self._chat_shape(items) if self.chat else self._completion_shape(items)

    def whole(self) -> dict | None:
        if self.num_top is None:
            return None
        self._offset = 0
        return self._chat_shape(self.entries) if self.chat else self._completion_shape(self.entries)

    def echo_prefix(self) -> str:
        """The prompt's text before the first piece of the answer (once), with echo."""
        if self.echo_text is None or self._echo_text_sent:
            return ""
        self._echo_text_sent = True
        return self.echo_text

    def _chat_shape(self, items) -> dict:
        content = []
        for token_id, entry in items:
            text = self._text(token_id)
            top = [] if entry is None else [
                {"token": self._text(t), "logprob": lp, "bytes": list(self._text(t).encode())}
                for t, lp in zip(entry.top_token_ids, entry.top_logprobs)]
            content.append({"token": text, "logprob": entry.logprob if entry is not None else None,
                            "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _completion_shape(self, items) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in items:
            text = self._text(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(entry.logprob)
            top = {self._text(t): lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
            top.setdefault(text, entry.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
