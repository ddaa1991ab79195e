"""RequestChannel: everything a request has produced, for streams that attach at any time.

A Generate stream follows a channel from a token index, so a stream that attaches
late (the router resuming a migrated request) sees every token exactly once from
that index on: nothing missing, nothing repeated.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dualpace.engine.request import RequestEvent
from dualpace.logprobs import TokenLogprobs
from dualpace.sampling_params import FinishReason


@dataclass(frozen=True)
class ChannelUpdate:
    first_token_index: int  # index in the request's output of new_token_ids[0]
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    migrated_to: str | None
    error_message: str | None = None  # set when the request ended with an error instead of a result
    engine_failed: bool = False  # with error_message: the whole engine failed, not just this request
    num_cached_tokens: int | None = None  # read from a Generate response's usage (the router's side)
    logprobs: tuple[TokenLogprobs | None, ...] = ()  # per new token when asked for (None: not held here)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # with the update holding output token 0


class RequestChannel:
    def __init__(self, request_id: str, num_prompt_tokens: int, output_token_ids: list[int] | None = None):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.output_token_ids: list[int] = list(output_token_ids or [])
        # Aligned with output_token_ids; tokens made elsewhere (before an import) have None.
        self.token_logprobs: list[TokenLogprobs | None] = [None] * len(self.output_token_ids)
        self.prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
        self.finish_reason: FinishReason | None = None
        self.migrated_to: str | None = None
        self.error_message: str | None = None
        self.engine_failed = False
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self._changed = asyncio.Condition()
        self.num_followers = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.migrated_to is not None

    async def publish(self, event: RequestEvent, error_message: str | None = None) -> None:
        """Add the event's tokens and outcome; `error_message` explains a FinishReason.ERROR of this
        request alone (e.g. non-finite logits): followers report it as an error, the engine serves on."""
        async with self._changed:
            self.output_token_ids.extend(event.new_token_ids)
            self.token_logprobs.extend(event.logprobs or (None,) * len(event.new_token_ids))
            if event.prompt_logprobs is not None:
                self.prompt_logprobs = event.prompt_logprobs
            if event.num_cached_tokens is not None:
                self.num_cached_tokens = event.num_cached_tokens
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
                if error_message is not None and self.error_message is None:
                    self.error_message = error_message
            if event.migrated_to is not None:
                self.migrated_to = event.migrated_to
            self._changed.notify_all()

    async def fail(self, message: str) -> None:
        """End the request because the engine failed; followers report the error (UNAVAILABLE)."""
        async with self._changed:
            self.error_message = message
            self.engine_failed = True
            self.finish_reason = self.finish_reason or FinishReason.ERROR
            self._changed.notify_all()

    async def follow(self, from_token_index: int = 0) -> AsyncIterator[ChannelUpdate]:
        """Yield new tokens from `from_token_index` on, until the request finishes or moves."""
        index = from_token_index
        self.num_followers += 1
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: len(self.output_token_ids) > index or self.done)
                    new_ids = tuple(self.output_token_ids[index:])
                    new_logprobs = tuple(self.token_logprobs[index:])
                    done = self.done
                first, index = index, len(self.output_token_ids)
                if new_ids or done:
                    yield ChannelUpdate(first, new_ids, self.finish_reason if done else None,
                                        self.migrated_to if done else None,
                                        self.error_message if done else None,
                                        self.engine_failed if done else False,
                                        logprobs=new_logprobs,
                                        prompt_logprobs=self.prompt_logprobs if first == 0 and new_ids else None)
                if done:
                    return
        finally:
            self.num_followers -= 1
