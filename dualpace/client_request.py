"""A client's Generate request as the router receives it (core type; the wire converts it)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpace.sampling_params import SamplingParams


@dataclass(frozen=True)
class ClientRequest:
    """A Generate request as the router received it, before tokenization."""

    request_id: str | None
    text: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    tools: list[dict] | None = None  # OpenAI tool objects, rendered by the chat template (HTTP front only)
