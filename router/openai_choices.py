"""How many choices an OpenAI request asks for: `n`, `best_of` and a list of prompts.

Pure checks, each error naming its field (InvalidArgument; the HTTP front answers 400).

`best_of` > n runs best_of candidates per prompt, each with the sampled tokens' log-probabilities
asked of the engine (logprobs = 0 when the client asked for none, and then not shown), and
answers with the n of highest cumulative log-probability (router/openai_answer.py), as OpenAI
and vLLM's V0 engine define it. Like OpenAI, it cannot be streamed: the best are known only at
the end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dualpace.errors import InvalidArgument
from dualpace.sampling_params import SamplingParams


def num_choices(n: int, best_of: int | None, num_prompts: int, max_choices: int) -> int:
    """n, checked: 1 <= n <= best_of (when set), and the candidates (best_of or n) times
    num_prompts <= max_choices."""
    if n < 1:
        raise InvalidArgument("n", f"must be an integer >= 1, got {n}")
    if best_of is not None and best_of < n:
        raise InvalidArgument("best_of", f"must be >= n ({n}), got {best_of}")
    candidates = n if best_of is None else best_of
    if candidates * num_prompts > max_choices:
        field = ("n" if best_of is None else "best_of") if num_prompts == 1 else "prompt"
        raise InvalidArgument(field, f"{num_prompts} prompt(s) x {candidates} candidates is "
                                     f"{candidates * num_prompts} engine requests; at most {max_choices} per request")
    return n


def ranked_params(n: int, best_of: int | None, stream: bool, params: SamplingParams) -> tuple[SamplingParams, bool]:
    """With best_of > n: the params asking the engine for the sampled tokens' logprobs (that the
    candidates are ranked by), and whether those logprobs are hidden from the answer (the client
    asked for none). Otherwise the params unchanged."""
    if best_of is None or best_of == n:
        return params, False
    if stream:
        raise InvalidArgument("best_of", f"best_of > n ({best_of} > {n}) cannot be streamed: the best "
                                         "candidates are known only when all have finished")
    if params.logprobs is not None:
        return params, False
    return replace(params, logprobs=0), True


def best_indices(cumulative_logprobs: list[float], n: int, best_of: int) -> list[int]:
    """The candidates to answer with, prompt-major: for each prompt's best_of candidates (indices
    p * best_of ...), the n of highest cumulative logprob, best first (ties: the lower index)."""
    chosen = []
    for first in range(0, len(cumulative_logprobs), best_of):
        group = range(first, first + best_of)
        chosen.extend(sorted(group, key=lambda i: (-cumulative_logprobs[i], i))[:n])
    return chosen


def split_prompts(prompt: Any) -> list[str | list[int]] | None:
    """The prompts of a /v1/completions `prompt` that is a list of several (strings or token-id
    lists), else None (one prompt: the caller parses it as before)."""
    if not isinstance(prompt, list) or len(prompt) < 2 or not all(isinstance(p, (str, list)) for p in prompt):
        return None
    for index, item in enumerate(prompt):
        if isinstance(item, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise InvalidArgument(f"prompt[{index}]", "must be a string or a list of token ids")
        if not item:
            raise InvalidArgument(f"prompt[{index}]", "is empty")
    return list(prompt)
