"""One OpenAI request's response shapes, over all its choices: the whole body, or the stream of
chunks, each choice numbered by its index (router/fan_out.py), with tool calls parsed from a chat
answer when the request had tools (router/openai_tools.py), and each choice's own logprobs and
echo (router/openai_logprobs.py: with a list of prompts, a choice echoes its own prompt). Pure: no
aiohttp, no sockets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dualpace.sampling_params import FinishReason
from router import openai_responses as responses
from router import openai_schema as schema
from router.fan_out import Choice, FanOut
from router.openai_choices import best_indices
from router.openai_logprobs import AnswerLogprobs
from router.openai_schema import ParsedRequest
from router.openai_tools import ToolCallStream, split_tool_calls
from router.relay import RelayUpdate

TOOL_CALLS = "tool_calls"  # OpenAI's finish reason when the answer is calls


@dataclass
class _ChoiceText:
    texts: list[str] = field(default_factory=list)
    reason: FinishReason | None = None
    tools: ToolCallStream | None = None  # streamed chat with tools: content with the calls held back
    logprobs: AnswerLogprobs | None = None  # with logprobs or echo: made at the choice's first update
    started: bool = False
    delta_logprobs: dict | None = None  # the logprobs object of the last update (streaming)
    cumulative_logprob: float = 0.0  # of the sampled tokens, when the engine reports them (best_of)


@dataclass
class Answer:
    parsed: ParsedRequest
    request_id: str
    model: str
    fan_out: FanOut

    def __post_init__(self) -> None:
        self.created = int(time.time())
        self.parses_calls = self.parsed.tools is not None and self.parsed.tools.parses_calls
        self._choices = [_ChoiceText(tools=ToolCallStream() if self.parses_calls else None)
                         for _ in range(self.fan_out.num_choices)]

    def _usage(self) -> dict:
        """Prompt tokens once per prompt (as OpenAI counts them), completion tokens of every choice."""
        relays = [c.relay for c in self.fan_out.choices if c is not None]
        firsts = [c.relay for c in self.fan_out.choices if c is not None and c.index % self.fan_out.n == 0]
        return responses.usage(sum(len(r.prompt_token_ids) for r in firsts),
                            sum(len(r.output_token_ids) for r in relays),
                            sum(r.num_cached_tokens for r in firsts))

    def add(self, choice: Choice, update: RelayUpdate) -> None:
        """Every update, streamed or not: remember the text, the logprobs and the finish reason."""
        state = self._choices[choice.index]
        if not state.started:
            state.started = True
            state.logprobs = AnswerLogprobs.for_choice(self.parsed, self.parsed.clients[choice.prompt_index],
                                                       self.fan_out.core.tokenizer, choice.relay.prompt_token_ids)
            if state.logprobs is not None and self.parsed.hides_logprobs:  # asked for ranking only
                state.logprobs.num_top = None
                state.logprobs = state.logprobs if state.logprobs.echo_text is not None else None
        state.texts.append(update.text)
        state.cumulative_logprob += sum(entry.logprob for entry in update.logprobs if entry is not None)
        if state.logprobs is not None:
            state.delta_logprobs = state.logprobs.take(update)
        if update.finish_reason is not None:
            state.reason = update.finish_reason

    @property
    def finished(self) -> bool:
        return all(c.reason is not None for c in self._choices)

    def whole(self) -> dict:
        shape = responses.chat_completion if self.parsed.chat else responses.completion
        body = None
        shown = range(len(self._choices))
        if self.parsed.best_of is not None:  # best_of > n: the n best candidates of each prompt
            shown = best_indices([c.cumulative_logprob for c in self._choices], self.parsed.n, self.parsed.best_of)
        for index, state in enumerate(self._choices[k] for k in shown):
            text, reason = "".join(state.texts), responses.finish_reason_text(state.reason)
            if state.logprobs is not None:
                text = state.logprobs.echo_prefix() + text
            calls = []
            if self.parses_calls:
                text, calls = split_tool_calls(text)
            one = shape(self.request_id, self.created, self.model, text, reason, {})
            entry = one["choices"][0]
            entry["index"] = index
            if state.logprobs is not None:
                entry["logprobs"] = state.logprobs.whole()
            if calls:
                entry["message"]["tool_calls"] = calls
                entry["finish_reason"] = TOOL_CALLS
            if body is None:
                body = one
            else:
                body["choices"].append(entry)
        body["usage"] = self._usage()
        return body

    # ---- streaming -----------------------------------------------------------

    def opening(self) -> list[dict]:
        if not self.parsed.chat:
            return []
        return self._counted([self._chat_chunk(index, {"role": "assistant", "content": ""}, None)
                              for index in range(self.fan_out.num_choices)])

    def _counted(self, chunks: list[dict]) -> list[dict]:
        """With continuous usage: each chunk carries the usage so far (completion tokens up to it)."""
        if self.parsed.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self._usage()
        return chunks

    def _chat_chunk(self, index: int, delta: dict, reason: str | None) -> dict:
        chunk = responses.chat_chunk(self.request_id, self.created, self.model, delta, reason, self.parsed.include_usage)
        chunk["choices"][0]["index"] = index
        return chunk

    def chunks(self, choice: Choice, update: RelayUpdate) -> list[dict]:
        """The chunks of one update, after add() took it."""
        index = choice.index
        reason = responses.finish_reason_text(update.finish_reason)
        state = self._choices[index]
        logprobs = state.delta_logprobs if state.logprobs is not None else None
        if not self.parsed.chat:
            text = (state.logprobs.echo_prefix() if state.logprobs is not None else "") + update.text
            if not text and reason is None and logprobs is None:
                return []
            chunk = responses.completion_chunk(self.request_id, self.created, self.model, text, reason,
                                            self.parsed.include_usage)
            chunk["choices"][0]["index"] = index
            chunk["choices"][0]["logprobs"] = logprobs
            return self._counted([chunk])
        tools = state.tools
        text = update.text if tools is None else tools.feed(update.text)
        out = []
        if reason is not None and tools is not None:
            text += tools.finish()
        if text or logprobs is not None:
            out.append(self._chat_chunk(index, {"content": text}, None))
            out[-1]["choices"][0]["logprobs"] = logprobs
        if reason is not None:
            if tools is not None and tools.calls:
                calls = [{"index": n, **call} for n, call in enumerate(tools.calls)]
                out.append(self._chat_chunk(index, {"tool_calls": calls}, None))
                reason = TOOL_CALLS
            out.append(self._chat_chunk(index, {}, reason))
        return self._counted(out)

    def usage_chunk(self) -> dict:
        return responses.usage_chunk(self.parsed.chat, self.request_id, self.created, self.model, self._usage())
