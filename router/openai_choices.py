"""How many choices an OpenAI request asks for: `n`, `best_of` and a list of prompts.

Pure checks, each error naming its field (InvalidArgument; the HTTP front answers 400).

`best_of` > n would rank best_of candidates by their cumulative log-probability and return the n
best. The engines do not report log-probabilities to the router yet, so there is nothing honest
to rank by: best_of = n (or absent) is served, best_of > n is refused saying why.
"""

from __future__ import annotations

from typing import Any

from dualpace.errors import InvalidArgument


def num_choices(n: int, best_of: int | None, num_prompts: int, max_choices: int) -> int:
    """n, checked: 1 <= n, best_of (when set) == n, and n * num_prompts <= max_choices."""
    if n < 1:
        raise InvalidArgument("n", f"must be an integer >= 1, got {n}")
    if best_of is not None:
        if best_of < n:
            raise InvalidArgument("best_of", f"must be >= n ({n}), got {best_of}")
        if best_of > n:
            raise InvalidArgument("best_of", f"best_of > n ({best_of} > {n}) ranks candidates by cumulative "
                                             "log-probability, which the engines do not report to the router yet; "
                                             "send best_of = n or leave it out")
    if n * num_prompts > max_choices:
        field = "n" if num_prompts == 1 else "prompt"
        raise InvalidArgument(field, f"{num_prompts} prompt(s) x n = {n} is {n * num_prompts} choices; "
                                     f"at most {max_choices} per request")
    return n


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
