"""One HTTP request, several choices: OpenAI's `n` and a list of prompts on /v1/completions.

Every choice is its own engine request (its own Relay: admission, migration and recovery work for
it as for any request). Choices are numbered prompt-major, as OpenAI numbers them: prompt p's
choice i has index p * n + i.

Sharing the prompt's KV: the first choice of each prompt starts at once; its siblings start when
it has produced its first token, so its prompt's full blocks are in its engine's prefix cache by
then, and they are admitted preferring that engine (Relay.prompt_cached_on): their prefill is a
prefix-cache hit and the blocks are shared (copy-on-write at the block level: a choice's own
tokens go into blocks of its own). Seeds are derived per choice, seed + i (mod 2^63), from the
request's seed or, without one, from the seed the first choice was given, so a seeded request
repeats, and choice 0 of n equals the n = 1 answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from dualpace.sampling_params import MAX_SEED
from router.relay import Relay, RelayUpdate
from router.router_core import RouterCore


def derived_seed(seed: int, choice_index: int) -> int:
    return (seed + choice_index) % (MAX_SEED + 1)


def choice_request_id(request_id: str, index: int, num_choices: int) -> str:
    """The engine request id of one choice (the request's own id when it has one choice)."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


@dataclass
class Choice:
    index: int  # in the response's choices (prompt-major)
    prompt_index: int
    relay: Relay


class FanOut:
    """The choices of one request and their updates, merged in arrival order."""

    def __init__(self, core: RouterCore, request_id: str, first_relays: Sequence[Relay], n: int):
        """first_relays: choice 0 of every prompt, opened (tokenized, validated) by the caller."""
        self.core = core
        self.request_id = request_id
        self.n = n
        self.num_choices = n * len(first_relays)
        self.choices: list[Choice | None] = [None] * self.num_choices
        for prompt_index, relay in enumerate(first_relays):
            self.choices[prompt_index * n] = Choice(prompt_index * n, prompt_index, relay)

    def _siblings(self, first: Choice) -> list[Choice]:
        """Choices 1..n-1 of `first`'s prompt, to run beside it on the engine holding its prompt."""
        relay = first.relay
        made = []
        for offset in range(1, self.n):
            index = first.index + offset
            params = replace(relay.params, seed=derived_seed(relay.params.seed, offset))
            sibling = Relay(self.core, choice_request_id(self.request_id, index, self.num_choices),
                            relay.prompt_token_ids, params, relay.client_deadline)
            sibling.prompt_cached_on = relay.tracked.engine.name if relay.tracked.engine is not None else None
            self.choices[index] = Choice(index, first.prompt_index, sibling)
            made.append(self.choices[index])
        return made

    async def updates(self) -> AsyncIterator[tuple[Choice, RelayUpdate]]:
        """(choice, update) until every choice finished; the first failure of any choice is
        raised (the others are then aborted). Closing this generator aborts what still runs."""
        if self.num_choices == 1:  # no tasks: the relay runs in the caller's task, as before
            only = self.choices[0]
            async with contextlib.aclosing(only.relay.run()) as updates:
                async for update in updates:
                    yield only, update
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        def start(choice: Choice) -> None:
            tasks.append(asyncio.create_task(self._pump(choice, queue)))

        for choice in list(self.choices):
            if choice is not None:
                start(choice)
        num_running = len(tasks)
        try:
            while num_running:
                choice, item = await queue.get()
                if item is None:  # this choice's stream ended
                    num_running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if choice.index % self.n == 0 and self.n > 1 and self.choices[choice.index + 1] is None:
                    for sibling in self._siblings(choice):
                        start(sibling)
                        num_running += 1
                yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def _pump(choice: Choice, queue: asyncio.Queue) -> None:
        try:
            async with contextlib.aclosing(choice.relay.run()) as updates:
                async for update in updates:
                    await queue.put((choice, update))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which fails the whole request
            await queue.put((choice, exc))
        finally:
            queue.put_nowait((choice, None))
