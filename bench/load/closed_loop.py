"""Closed-loop pieces for benchmarks that send one request at a time and compare it with a cold twin.

- send_one: one request through the router's Generate stream, waited for, as a small dict of what it measured;
- cold_twin: the same prompt with its first token changed, so no prefix cache holds any block of it
  (blocks are identified by a hash chained from the first one), at the same length (pure).
"""

from __future__ import annotations

import asyncio

from bench.load.generator import run_load
from toolkit.workload import RequestSpec


def cold_twin(prompt_token_ids: list[int], vocab_size: int) -> list[int]:
    """prompt_token_ids with its first token replaced by another id in [1, vocab_size): the same length and
    the same later tokens, but every block's chained hash differs from the original's."""
    if vocab_size < 3:
        raise ValueError(f"a cold twin needs a vocabulary of at least 3 ids, got {vocab_size}")
    if not prompt_token_ids:
        raise ValueError("a cold twin needs at least one prompt token")
    return [prompt_token_ids[0] % (vocab_size - 1) + 1] + list(prompt_token_ids[1:])


def send_one(router: str, index: int, prompt: list[int], output_len: int, tag: str,
             timeout_s: float = 600.0) -> dict:
    """Send one request and wait for it; SystemExit naming it if it does not complete."""
    result = asyncio.run(run_load(router, [RequestSpec(index, 0.0, tuple(prompt), output_len)], timeout_s=timeout_s,
                                  run_tag=tag))
    record = result.records[0]
    if not record.completed:
        raise SystemExit(f"request {index} failed: {record.status} {record.detail}")
    return {"prompt_tokens": len(prompt), "ttft_ms": round(record.ttft_s() * 1e3, 2),
            "e2e_ms": round((record.end_s - record.sent_s) * 1e3, 2), "num_output_tokens": record.num_tokens,
            "engines": record.engines, "cached_tokens": record.num_cached_tokens,
            "output_token_ids": record.output_token_ids}
