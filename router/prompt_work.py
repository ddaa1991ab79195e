"""Prompt work off the router's event loop.

Tokenizing a prompt and rendering a chat template are CPU work proportional to the prompt's
size: done on the event loop, a large prompt stalls every stream the router relays meanwhile.
`PromptWork.prepare` (one per RouterCore) runs router.prompts.prepare_prompt in a bounded pool
of worker threads instead (Tokenizer.encode tokenizes a long text without holding the GIL; the
plain backend call would hold it throughout, seconds for a megabyte, and stall the loop as much
as running it there), after an early, O(1) check of the prompt's size against
`--max-prompt-chars`, so that an oversized prompt is refused with INVALID_ARGUMENT naming the
limit before any of it is tokenized.

A request far over that limit never reaches Python at all: the router's gRPC server refuses a
message over `PromptLimits.receive_bytes` (`--max-request-bytes`, by default 4 bytes per allowed
character, UTF-8's most, plus REQUEST_SLACK_BYTES) with RESOURCE_EXHAUSTED ("Received message
larger than max (N vs. LIMIT)") inside gRPC's C core. Receiving a 10 MB message in Python costs
the event loop about 45 ms (measured on a 2-core EPYC: gRPC copying it into a bytes object,
about 25 ms; parsing it, 10 ms; making its text a str, 10 ms), a gap in every stream the router
relays meanwhile, and no thread helps, as each of those steps holds the GIL. Within that bound
a prompt over `--max-prompt-chars` gets the INVALID_ARGUMENT naming the limit.

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
UTF8_MAX_BYTES_PER_CHAR = 4
REQUEST_SLACK_BYTES = 1 << 20  # sampling, stop strings, the chat messages' framing, a long token-id prompt
MAX_GRPC_MESSAGE_BYTES = (1 << 31) - 1  # gRPC's limits are C ints


@dataclass(frozen=True)
class PromptLimits:
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    num_workers: int = DEFAULT_PROMPT_WORKERS
    max_request_bytes: int | None = None  # None: derived from max_prompt_chars (receive_bytes)

    def __post_init__(self) -> None:
        if self.max_prompt_chars < 1:
            raise InvalidArgument("--max-prompt-chars", f"must be >= 1, got {self.max_prompt_chars}")
        if self.num_workers < 1:
            raise InvalidArgument("--prompt-workers", f"must be >= 1, got {self.num_workers}")
        if self.max_request_bytes is not None and not 1 <= self.max_request_bytes <= MAX_GRPC_MESSAGE_BYTES:
            raise InvalidArgument("--max-request-bytes",
                                  f"must be between 1 and {MAX_GRPC_MESSAGE_BYTES}, got {self.max_request_bytes}")

    @property
    def receive_bytes(self) -> int:
        """The largest gRPC request the router receives: --max-request-bytes, else room for a
        prompt of max_prompt_chars characters of any kind and the rest of the request."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return min(UTF8_MAX_BYTES_PER_CHAR * self.max_prompt_chars + REQUEST_SLACK_BYTES, MAX_GRPC_MESSAGE_BYTES)


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
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="refuse a gRPC request larger than this with RESOURCE_EXHAUSTED inside gRPC, before "
                             "the router reads it (default: 4 bytes per --max-prompt-chars character + 1 MiB)")
