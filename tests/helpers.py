"""Helpers shared by the tests (fixtures live in tests/conftest.py)."""

from __future__ import annotations

from dualpace.generation import OfflineGenerator
from dualpace.sampling import SamplingParams


def reference_tokens(loaded, prompt: list[int], params: SamplingParams, block_size: int | None = None) -> list[int]:
    """What the request generates alone, in process (the OfflineGenerator reference path)."""
    generator = OfflineGenerator(loaded) if block_size is None else OfflineGenerator(loaded, block_size=block_size)
    return generator.generate([list(prompt)], [params])[0].output_token_ids
