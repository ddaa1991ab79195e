"""Prompt work off the router's event loop.

Tokenizing a prompt and rendering a chat template are CPU work proportional to the prompt's
size: done on the event loop, a large prompt stalls every stream the router relays meanwhile.
`PromptWork.prepare` (one per RouterCore) runs router.prompts.prepare_prompt in a bounded pool of worker threads
instead (the tokenizers release the GIL for most of their work), after an early, O(1) check of
the prompt's size against `--max-prompt-chars`, so that an oversized prompt is refused with
INVALID_ARGUMENT naming the limit before any of it is tokenized.

Both fronts call it: the gRPC servicer (router/service.py) and the OpenAI-compatible HTTP front
(router/http_api.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dualpace.errors import InvalidArgument
from dualpace.model.config import ModelConfig
from dualpace.model.tokenizer import Tokenizer
from dualpace.sampling_params import SamplingParams
from dualpace.client_request import ClientRequest
from router.prompts import prepare_prompt

DEFAULT_MAX_PROMPT_CHARS = 1 << 20  # far beyond any context window here; a 10 MB prompt is refused at once
DEFAULT_PROMPT_WORKERS = 2


@dataclass(frozen=True)
class PromptLimits:
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    num_workers: int = DEFAULT_PROMPT_WORKERS

    def __post_init__(self) -> None:
        if self.max_prompt_chars < 1:
            raise InvalidArgument("--max-prompt-chars", f"must be >= 1, got {self.max_prompt_chars}")
        if self.num_workers < 1:
            raise InvalidArgument("--prompt-workers", f"must be >= 1, got {self.num_workers}")


class PromptWork:
    def __init__(self, limits: PromptLimits | None = None) -> None:
        self.limits = limits or PromptLimits()
        self._pool = ThreadPoolExecutor(self.limits.num_workers, thread_name_prefix="router-prompt")

    def check_size(self, client: ClientRequest) -> None:
        """Refuse a prompt longer than the limit, naming the field and the limit (no tokenizing)."""
        limit = self.limits.max_prompt_chars
        if client.text is not None:
            field, size = "text", len(client.text)
        elif client.messages is not None:
            field = "messages"
            size = sum(len(m.get("content", "")) if isinstance(m.get("content"), str) else 0 for m in client.messages)
        else:
            return  # token ids: validate_request bounds them by the model's context, cheaply
        if size > limit:
            raise InvalidArgument(field, f"the prompt is {size} characters; this router takes at most {limit} "
                                         f"(--max-prompt-chars)")

    async def prepare(self, client: ClientRequest, tokenizer: Tokenizer,
                      model_config: ModelConfig) -> tuple[list[int], SamplingParams]:
        self.check_size(client)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, prepare_prompt, client, tokenizer, model_config)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def add_prompt_arguments(parser) -> None:
    parser.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS,
                        help="refuse a prompt (text, or the chat messages' contents together) longer than this "
                             "with INVALID_ARGUMENT, before tokenizing it")
    parser.add_argument("--prompt-workers", type=int, default=DEFAULT_PROMPT_WORKERS,
                        help="threads that tokenize prompts and render chat templates, off the event loop")
